"""Schedules against closed forms at begin, end and end+1; monotone; in range; bad arguments raise."""

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from recal_core import load_recipe
from recal_core import schedules as S


def test_epoch_to_step_rounds_half_up():
    assert [S.epoch_to_step(e, 4) for e in (0, 0.125, 0.25, 2.5, 3)] == [0, 1, 1, 10, 12]
    assert S.epoch_to_step(0.5, 1) == 1 and S.epoch_to_step(2.5, 1) == 3
    with pytest.raises(ValueError):
        S.epoch_to_step(1, 0)


@pytest.mark.parametrize("func, exponent", [("linear", 1), ("cubic", 3), ("inverse_cubic", 1 / 3)])
def test_gradual_sparsity_closed_form(func, exponent):
    init, final, start, end, every = 0.05, 0.8, 10, 30, 4
    s = S.gradual_sparsity(init, final, start, end, every, func)
    assert s(start - 1) is None
    assert s(start) == pytest.approx(init)
    for k in range(start, end):
        u = start + (k - start) // every * every
        p = (u - start) / (end - start)
        assert s(k) == pytest.approx(init + (final - init) * (1 - (1 - p) ** exponent))
    assert s(end) == final and s(end + 1) == final and s(10**6) == final


def test_gradual_sparsity_released_without_leave_enabled():
    s = S.gradual_sparsity(0.0, 0.5, 0, 10, 1, "linear", leave_enabled=False)
    assert s(10) == 0.5 and s(11) is None


@settings(max_examples=200, deadline=None)
@given(st.floats(0, 0.9), st.floats(0, 0.09), st.integers(0, 50), st.integers(1, 200), st.integers(1, 20),
       st.sampled_from(["linear", "cubic", "inverse_cubic"]))
def test_gradual_sparsity_monotone_and_in_range(init, delta, start, length, every, func):
    final = min(init + delta, 0.999)
    s = S.gradual_sparsity(init, final, start, start + length, every, func)
    values = [s(k) for k in range(start, start + length + 3)]
    assert all(init - 1e-12 <= v <= final + 1e-12 for v in values)
    assert all(a <= b + 1e-12 for a, b in zip(values, values[1:]))
    assert values[0] == pytest.approx(init) and values[length] == final


def test_update_steps():
    is_update = S.update_steps(3, 10, 3)
    assert [k for k in range(15) if is_update(k)] == [3, 6, 9, 10]


@pytest.mark.parametrize("args", [(0.5, 0.4, 0, 10, 1), (0.1, 1.0, 0, 10, 1), (-0.1, 0.5, 0, 10, 1),
                                  (0.1, 0.5, -1, 10, 1), (0.1, 0.5, 0, 10, 0)])
def test_gradual_sparsity_bad_arguments_raise(args):
    with pytest.raises(ValueError):
        S.gradual_sparsity(*args)


def test_interpolate_bad_function():
    with pytest.raises(ValueError):
        S.interpolate(0.5, 0, 1, "quadratic")


def test_lr_closed_forms():
    exp = S.exponential_lr(0.1, 0.5, 4, 10)
    assert [exp(k) for k in (4, 13, 14, 34)] == pytest.approx([0.1, 0.1, 0.05, 0.0125])
    step = S.step_lr(1.0, 0.1, 0, 20)
    assert [step(k) for k in (0, 19, 20, 40)] == pytest.approx([1.0, 1.0, 0.1, 0.01])
    multi = S.multistep_lr(1.0, 0.5, [30, 10])
    assert [multi(k) for k in (9, 10, 29, 30)] == pytest.approx([1.0, 0.5, 0.5, 0.25])
    with pytest.raises(ValueError):
        S.exponential_lr(0, 0.5, 0, 10)
    with pytest.raises(ValueError):
        S.step_lr(1.0, 0.5, 0, 0)


def test_pruned_count():
    assert [S.pruned_count(s, 10) for s in (0, 0.04, 0.05, 0.8, 0.99)] == [0, 0, 1, 8, 10]
    assert S.pruned_count(0.5, 7) == 4


@pytest.mark.parametrize("lr_class, kwargs", [
    ("ExponentialLR", {"gamma": 0.9}), ("StepLR", {"gamma": 0.5, "step": 2}),
    ("MultiStepLR", {"gamma": 0.1, "milestones": [3, 6]})])
def test_lr_same_at_epoch_boundaries_for_any_steps_per_epoch(lr_class, kwargs):
    import yaml

    recipe = load_recipe(
        "- !EpochRangeModifier {start_epoch: 0, end_epoch: 10}\n"
        f"- !LearningRateModifier {{start_epoch: 1, end_epoch: 9, lr_class: {lr_class}, "
        f"lr_kwargs: {yaml.safe_dump(kwargs, default_flow_style=True).strip()}, init_lr: 0.2}}")
    per_epoch = {spe: [recipe.bind(spe).lr(epoch * spe) for epoch in range(11)] for spe in (1, 3, 7, 100)}
    for spe, values in per_epoch.items():
        assert values == pytest.approx(per_epoch[1]), spe
    assert per_epoch[1][0] is None or math.isclose(per_epoch[1][1], 0.2)


def test_recipe_schedule_boundaries_and_conventions():
    recipe = load_recipe("""
- !EpochRangeModifier {start_epoch: 0, end_epoch: 6}
- !GradualKSModifier {params: __ALL__, init_sparsity: 0.1, final_sparsity: 0.5, start_epoch: 1, end_epoch: 3,
                      update_frequency: 0.5, inter_func: linear}
- !ConstantKSModifier {params: __ALL__, start_epoch: 3.5}
- !SetLearningRateModifier {start_epoch: 0, learning_rate: 0.1}
- !LearningRateModifier {start_epoch: 2, end_epoch: 4, lr_class: ExponentialLR, lr_kwargs: {gamma: 0.5}}
- !SetWeightDecayModifier {start_epoch: 1.5, weight_decay: 0.001}
- !TrainableParamsModifier {params: ["fc.weight"], trainable: false, start_epoch: 1, end_epoch: 2}
- !QuantizationModifier {start_epoch: 4, freeze_bn_stats_epoch: 5, disable_quantization_observer_epoch: 5.5}
""")
    s = recipe.bind(4)
    assert s.total_steps == 24
    gks, cks = s.pruning
    assert gks.sparsity(3) is None
    assert [gks.sparsity(k) for k in (4, 5, 6, 7, 8, 11, 12, 13)] == pytest.approx(
        [0.1, 0.1, 0.2, 0.2, 0.3, 0.4, 0.5, 0.5])
    assert gks.sparsity(6) == pytest.approx(0.2) and gks.sparsity(12) == 0.5
    assert [k for k in range(25) if gks.is_update(k)] == [4, 6, 8, 10, 12]
    assert cks.span.start == 14 and cks.mask_in_force(14) and not cks.mask_in_force(13)
    # LR: SetLR, then an ExponentialLR starting from the LR in force (0.1) at epoch 2, held after its end
    assert [s.lr(k) for k in (0, 7, 8, 11, 12, 15, 16, 24)] == pytest.approx(
        [0.1, 0.1, 0.1, 0.1, 0.05, 0.05, 0.05, 0.05])
    assert s.weight_decay(5) is None and s.weight_decay(6) == 0.001
    assert s.trainable_rules(3) == [] and len(s.trainable_rules(4)) == 1 and s.trainable_rules(8) == []
    qat = recipe.modifiers.index(next(m for m in recipe.modifiers if m.tag == "QuantizationModifier"))
    assert not s.qat(qat, 15).enabled and s.qat(qat, 16).enabled and not s.qat(qat, 16).bn_frozen
    assert s.qat(qat, 20).bn_frozen and not s.qat(qat, 21).observers_frozen and s.qat(qat, 22).observers_frozen


def test_later_starting_lr_modifier_wins_and_base_lr_seeds():
    recipe = load_recipe("""
- !EpochRangeModifier {start_epoch: 0, end_epoch: 4}
- !LearningRateModifier {start_epoch: 0, end_epoch: 4, lr_class: StepLR, lr_kwargs: {gamma: 0.1, step: 1}}
- !SetLearningRateModifier {start_epoch: 2, learning_rate: 0.3}
""")
    s = recipe.bind(2)
    assert s.needs_base_lr()
    assert [s.lr(k, base_lr=1.0) for k in (0, 1, 2, 3, 4, 8)] == pytest.approx([1, 1, 0.1, 0.1, 0.3, 0.3])
    with pytest.raises(ValueError, match="init_lr"):
        s.lr(0)


def test_bind_rejects_bad_steps_per_epoch():
    recipe = load_recipe("- !EpochRangeModifier {start_epoch: 0, end_epoch: 4}")
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError):
            recipe.bind(bad)


# --- LearningRateFunctionModifier and CosineAnnealingWarmRestarts ------------------------------------

def test_function_lr_closed_forms_at_begin_end_and_after():
    """SparseML 1.8's closed forms, step for step: position (k - start) / (end - start), so the last step of a
    cycle is one step short of final_lr, held after the end."""
    import math

    from recal_core.schedules import function_lr

    linear = function_lr(0.1, 0.01, 10, 20, "linear")
    assert linear(0) == 0.1 and linear(10) == 0.1 and linear(19) == pytest.approx(0.1 - 0.09 * 0.9)
    assert linear(25) == linear(19)
    values = [linear(k) for k in range(10, 20)]
    assert all(a > b for a, b in zip(values, values[1:]))  # strictly down
    cosine = function_lr(0.1, 0.0, 0, 10, "cosine")
    assert cosine(0) == 0.1 and cosine(5) == pytest.approx(0.05) and cosine(9) == pytest.approx(
        0.05 * (1 + math.cos(math.pi * 0.9)))
    assert cosine(3) == pytest.approx(0.05 * (1 + math.cos(math.pi * 0.3)))
    # the figure: SparseML 1.8 on a 1-8 cosine from 0.1 to 0.002, one step per epoch, at epoch 2
    assert function_lr(0.1, 0.002, 1, 8, "cosine")(2) == pytest.approx(0.0951, abs=5e-5)
    cyclic = function_lr(1.0, 0.0, 0, 10, "cyclic_linear", cycle_steps=4)
    assert [cyclic(k) for k in range(10)] == pytest.approx([1, 3 / 4, 1 / 2, 1 / 4, 1, 3 / 4, 1 / 2, 1 / 4, 1, 1 / 2])
    warmup = function_lr(0.0, 0.1, 0, 5, "linear")  # from 0: a warm-up
    assert warmup(0) == 0.0 and warmup(4) == pytest.approx(0.08)
    with pytest.raises(ValueError):
        function_lr(0.1, 0.01, 5, 5, "linear")
    with pytest.raises(ValueError):
        function_lr(0.1, 0.01, 0, 5, "exponential")


def test_cosine_warm_restarts_matches_torch():
    import torch

    from recal_core.schedules import cosine_warm_restarts_lr

    for t_mult in (1, 2):
        ours = cosine_warm_restarts_lr(0.1, 0.001, 0, 5, t_mult)
        opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
        sched = torch.optim.lr_scheduler.CosineAnnealingWarmRestarts(opt, T_0=5, T_mult=t_mult, eta_min=0.001)
        for k in range(40):
            assert ours(k) == pytest.approx(opt.param_groups[0]["lr"], rel=1e-9), (t_mult, k)
            opt.step()
            sched.step()


def test_sparseml_lr_function_recipes_bind_and_sets_only_named_groups():
    recipe = load_recipe("""
- !LearningRateFunctionModifier {start_epoch: 0, end_epoch: 2, lr_func: linear, init_lr: 0.0, final_lr: 0.1,
                                 param_groups: [1]}
- !LearningRateFunctionModifier {start_epoch: 0, end_epoch: 2, lr_func: cosine, init_lr: 0.1, final_lr: 0.01,
                                 param_groups: [0]}
- !LearningRateModifier {start_epoch: 2, end_epoch: 6, lr_class: CosineAnnealingWarmRestarts,
                         lr_kwargs: {lr_min: 0.001, cycle_epochs: 2}, init_lr: 0.05}
""")
    s = recipe.bind(steps_per_epoch=5)
    assert s.lr(0, group=1) == 0.0 and s.lr(9, group=1) == pytest.approx(0.1 * 9 / 10)
    assert s.lr(0, group=0) == 0.1 and s.lr(9, group=0) == pytest.approx(
        0.01 + 0.09 * (1 + math.cos(math.pi * 0.9)) / 2)
    assert s.lr(10, group=0) == s.lr(10, group=1) == 0.05 and s.lr(20, group=1) == 0.05  # restarted
    assert recipe.max_epochs == 6


def test_acdc_alternates_and_ends_compressed():
    recipe = load_recipe("""
- !ACDCPruningModifier {params: __ALL_PRUNABLE__, compression_sparsity: 0.9, start_epoch: 1, end_epoch: 6,
                        update_frequency: 1}
- !EpochRangeModifier {start_epoch: 0, end_epoch: 8}
""")
    s = recipe.bind(steps_per_epoch=2)
    ps = s.pruning[0]
    phases = [ps.sparsity(k) for k in range(0, 16)]
    assert phases == [None, None, 0.9, 0.9, None, None, 0.9, 0.9, None, None, 0.9, 0.9, 0.9, 0.9, 0.9, 0.9]
    assert [k for k in range(16) if ps.is_update(k)] == [2, 6, 10]
