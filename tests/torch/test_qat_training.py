"""Training with PyTorch QAT: the switch keeps optimizer state and sparsity, observers and BatchNorm freeze, resume,
torch.compile, learned scales."""

import warnings

import numpy as np
import pytest
import torch

from recal_core.schedules import pruned_count
from recal_torch import QATConv, ScheduledModifierManager
from recal_torch.export import to_export_model
from tests.support.torch_models import SmallCNN, assert_same_state, batches, load_checkpoint, train_steps
from tests.torch.qat_models import PRUNE_QAT, SPE, SqueezeExcite, _checkpoint, _int8, _run_prune_qat, _small_cnn_under


def test_qat_switch_keeps_optimizer_state_and_sparsity():
    model, manager, optimizer = _run_prune_qat(opt="adam")
    data = batches(20)
    weight = model.conv2.weight
    start = manager.schedule.step(2.5)
    train_steps(model, optimizer, data, stop=start - 1)
    assert not isinstance(model.conv2, QATConv)
    exp_avg = optimizer.state[weight]["exp_avg"].clone()
    train_steps(model, optimizer, data, start=start - 1, stop=start)
    assert isinstance(model.conv2, QATConv) and model.conv2.weight is weight
    assert not torch.equal(optimizer.state[weight]["exp_avg"], exp_avg)  # same state entry kept updating
    assert optimizer.param_groups[0]["lr"] == 0.01
    train_steps(model, optimizer, data, start=start, stop=manager.max_epochs * SPE)
    for name in ("conv1", "conv2", "conv3", "fc"):
        w = getattr(model, name).weight
        assert int((w == 0).sum()) == pruned_count(0.7, w.numel()), name
    assert model.conv2.bn_frozen and not model.conv2.activation_post_process.observer_enabled
    exported = to_export_model(model)
    for name in ("conv1", "conv2", "conv3", "fc"):
        q = getattr(exported, name).weight_int8
        assert torch.equal(q == 0, getattr(model, name).weight == 0) or bool(
            torch.all(q[getattr(model, name).weight == 0] == 0)), name


def test_observers_and_bn_freeze_at_their_epochs():
    model, manager, optimizer = _run_prune_qat()
    data = batches(20)
    seen = {}

    def record(k):
        if isinstance(model.conv2, QATConv):
            seen[k] = (model.conv2.bn_frozen, model.conv2.activation_post_process.observer_enabled)

    train_steps(model, optimizer, data, stop=manager.max_epochs * SPE, after_step=record)
    assert min(seen) == 10  # 2.5 epochs * 4
    assert seen[13] == (False, True) and seen[14] == (True, True) and seen[16] == (True, False)


@pytest.mark.parametrize("resume_at", [3, 6, 11, 15])
def test_resume_is_bit_identical(resume_at):
    data = batches(24)
    total = 5 * SPE
    model_a, manager_a, opt_a = _run_prune_qat()
    ckpt = {}
    train_steps(model_a, opt_a, data, stop=total,
                after_step=lambda k: ckpt.update(_checkpoint(model_a, opt_a)) if k == resume_at else None)
    import copy
    ckpt = copy.deepcopy(ckpt)

    model_b, manager_b, opt_b = _run_prune_qat(seed=123)  # different init: everything must come from ckpt
    opt_b.load_state_dict(ckpt["optimizer"])  # restores recal state first (re-creates QAT modules)
    model_b.load_state_dict(ckpt["model"])
    assert manager_b.step == resume_at
    train_steps(model_b, opt_b, data, start=resume_at, stop=total)
    assert_same_state(model_a, model_b)
    assert opt_a.param_groups[0]["lr"] == opt_b.param_groups[0]["lr"]
    for name in manager_a.masks.effective:
        assert torch.equal(manager_a.masks.effective[name], manager_b.masks.effective[name])


def test_resume_refuses_other_recipe_or_steps():
    model, manager, optimizer = _run_prune_qat()
    state = manager.state_dict()
    other = ScheduledModifierManager.from_yaml(PRUNE_QAT.replace("0.7", "0.6"))
    m = SmallCNN()
    other.modify(m, torch.optim.SGD(m.parameters(), lr=0.1), steps_per_epoch=SPE)
    with pytest.raises(ValueError, match="different recipe"):
        other.load_state_dict(state)
    again = ScheduledModifierManager.from_yaml(PRUNE_QAT)
    m = SmallCNN()
    again.modify(m, torch.optim.SGD(m.parameters(), lr=0.1), steps_per_epoch=SPE + 1)
    with pytest.raises(ValueError, match="steps_per_epoch"):
        again.load_state_dict(state)


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_pruning_and_qat_train_the_same_under_torch_compile(backend):
    """A recipe pruning from step 0 and starting QAT mid-run trains a ``torch.compile``'d model exactly as the
    plain one: QAT's first-forward plan records outside the compiled region (a graph break) and plans the same
    call sites (the squeeze-excitation's SiLUs, sigmoid and product), and the losses agree step by step (to float
    order, later on)."""
    from recal_torch.qat import QATPlanWarning

    recipe = ("- !GradualKSModifier {params: __ALL_PRUNABLE__, init_sparsity: 0.2, final_sparsity: 0.5, "
              "start_epoch: 0, end_epoch: 2, update_frequency: 1}\n- !QuantizationModifier {start_epoch: 1}\n")
    losses, sites = {}, {}
    for compiled in (False, True):
        torch.manual_seed(0)
        model = SqueezeExcite()
        manager = ScheduledModifierManager.from_yaml(recipe)
        optimizer = manager.modify(model, torch.optim.SGD(model.parameters(), lr=0.01), steps_per_epoch=3)
        run = torch.compile(model, backend=backend) if compiled else model
        losses[compiled] = []
        with warnings.catch_warnings():
            warnings.simplefilter("error", QATPlanWarning)  # a plan that could not record would warn
            for x, y in batches(7, batch=8):
                loss = torch.nn.functional.binary_cross_entropy(run(x), torch.nn.functional.one_hot(y, 10).float())
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                losses[compiled].append(float(loss.detach()))
        sites[compiled] = sorted(model.recal_sites)
    assert sites[True] == sites[False] and len(sites[True]) == 5, sites
    # the same through QAT's first steps; later a compiled graph's other float order moves a value on a rounding
    # boundary to the next step now and then (measured: 2.5e-4 of the loss by step 6)
    np.testing.assert_allclose(losses[True][:5], losses[False][:5], rtol=1e-5)
    np.testing.assert_allclose(losses[True], losses[False], rtol=1e-3)


@pytest.mark.filterwarnings("ignore:step .* learned scale.*fc.input_fake_quant:UserWarning")
def test_learned_input_scales_start_from_the_ranges_of_their_calibration_steps():
    """``observer_kwargs: {calibration_steps: 3}``: an input's learned scale starts from the first three training
    batches' ranges averaged (set at each of their forwards, then only trained); a run stopped mid-calibration
    resumes bit for bit; calibration on weights, or of zero steps, is a located error."""
    import copy

    from recal_core import RecipeError
    from recal_torch.qat import activation_qparams

    recipe = ("- !QuantizationModifier {start_epoch: 0, scheme: {weights: {}, input_activations: {symmetric: false, "
              "observer: lsq, observer_kwargs: {calibration_steps: 3}}}}\n")
    data = batches(8)

    def fresh():
        model, _, optimizer = _small_cnn_under(recipe, lambda p: torch.optim.SGD(p, lr=0.05))
        return model, optimizer

    model, optimizer = fresh()
    scales, ckpt = [], {}
    model.conv1.register_forward_hook(lambda m, args, out: scales.append(m.input_fake_quant.scale.detach().clone()))
    def keep(k):
        if k == 2:  # mid-calibration
            ckpt.update(copy.deepcopy({"model": model.state_dict(), "optimizer": optimizer.state_dict()}))

    train_steps(model, optimizer, data, after_step=keep)
    fq = model.conv1.input_fake_quant
    lo = torch.stack([x.min() for x, _ in data[:3]]).mean()
    hi = torch.stack([x.max() for x, _ in data[:3]]).mean()
    torch.testing.assert_close(fq.min_val, lo)
    torch.testing.assert_close(fq.max_val, hi)
    scales = scales[-len(data):]  # one per step (the plan's first forward recorded before them)
    torch.testing.assert_close(scales[2], activation_qparams(lo, hi)[0])  # the start, at the third batch
    assert int(fq.calibrated) == 3 and not torch.equal(scales[3], scales[7])  # then trained
    resumed, resumed_opt = fresh()
    load_checkpoint(resumed, resumed_opt, ckpt)
    train_steps(resumed, resumed_opt, data, start=2)
    assert_same_state(model, resumed)
    with pytest.raises(RecipeError, match=r"calibration_steps goes with input_activations"):
        ScheduledModifierManager.from_yaml(recipe.replace("weights: {}", "weights: {observer: lsq, observer_kwargs: "
                                                          "{calibration_steps: 2}}"))
    with pytest.raises(RecipeError, match=r"calibration_steps must be a whole number of steps from 1"):
        ScheduledModifierManager.from_yaml(recipe.replace("calibration_steps: 3", "calibration_steps: 0"))


@pytest.mark.filterwarnings("ignore:step .* learned scale.*fc.input_fake_quant:UserWarning")
def test_learned_scales_for_w8a8_weights_and_inputs_train_freeze_resume_and_convert(tmp_path):
    """``observer: lsq`` on a W8A8 scheme's weights and input activations: per-channel weight scales (from minmax)
    and the input quantizers' scales (from the first batch's range) train in param groups of their own, one per
    LR factor; they stop at the observers' freeze; a resumed run ends on the same bits; the int8 model verifies
    exactly as for observed scales (``quantized_layers`` says which scales are learned)."""
    import copy

    recipe = ("- !QuantizationModifier {start_epoch: 1, disable_quantization_observer_epoch: 2.5, scheme: "
              "{input_activations: {symmetric: false, observer: lsq}, weights: {observer: lsq, observer_kwargs: "
              "{lr_factor: %g}}}}\n")
    data = batches(12)

    def fresh(seed, factor=0.01):
        return _small_cnn_under(recipe % factor, lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9), seed)

    model, manager, optimizer = fresh(0)
    seen, ckpt = {}, {}

    def after(k):
        seen[k] = {n: p.detach().clone() for n, p in model.named_parameters() if n.endswith("scale")}
        if k == 6:
            ckpt.update(copy.deepcopy({"model": model.state_dict(), "optimizer": optimizer.state_dict()}))

    train_steps(model, optimizer, data, after_step=after)
    weights, inputs = optimizer.param_groups[1:]
    assert len(weights["params"]) == 4 and weights["lr"] == pytest.approx(0.0005)  # conv1..3, fc
    assert len(inputs["params"]) == 2 and inputs["lr"] == pytest.approx(0.05)  # the model's input, and fc's
    assert "per channel (learned scales), input uint8 (learned scale)" in manager.quantized_layers["conv1"]
    assert all(not torch.equal(seen[5][n], seen[9][n]) for n in seen[9])  # every learned scale moved
    assert all(torch.equal(seen[10][n], seen[12][n]) for n in seen[12])  # frozen from step 10
    resumed, _, resumed_opt = fresh(1)
    load_checkpoint(resumed, resumed_opt, ckpt)
    train_steps(resumed, resumed_opt, data[6:])
    assert_same_state(model, resumed)
    manager.finalize(model)
    result = _int8(model, tmp_path, False)
    assert result.verification.local_steps <= 1 and result.verification.max_steps <= 1, result.verification
    # under SGD a scale steps by its gradient: an LR that takes weight scales through zero holds them at eps, said
    # at the first step it happens, naming them
    from recal_core.errors import RecipeWarning

    model, manager, optimizer = fresh(0, factor=10)
    with pytest.warns(RecipeWarning, match=r"step \d: \d learned scale\(s\) at float32's eps .*weight_fake_quant.scale"
                                           r".*under SGD a scale steps by its gradient: lower observer_kwargs lr_factor"):
        train_steps(model, optimizer, data)


def test_under_adam_learned_scales_step_in_log_space_and_never_reach_the_floor():
    """AdamW moves a parameter by about its LR a step whatever its size: on the raw scale, weight scales of ~1e-2 at
    LR 0.05 went through zero and were floored. In log space each step is AdamW's step on ``log s``: the scales stay
    positive, each moves by a share of itself, and a resumed run ends on the same bits."""
    import copy

    from recal_torch.qat import EPS

    recipe = ("- !QuantizationModifier {start_epoch: 0, scheme: {input_activations: {symmetric: false, observer: lsq},"
              " weights: {observer: lsq}}}\n")
    data = batches(12)

    def fresh():
        return _small_cnn_under(recipe, lambda p: torch.optim.AdamW(p, lr=0.05))

    model, manager, optimizer = fresh()
    seen, ckpt = {}, {}

    def after(k):
        seen[k] = {n: p.detach().clone() for n, p in model.named_parameters() if n.endswith("scale")}
        if k == 5:
            ckpt.update(copy.deepcopy({"model": model.state_dict(), "optimizer": optimizer.state_dict()}))

    train_steps(model, optimizer, data, after_step=after)
    for k in range(2, 13):  # AdamW's first step is lr * sign: exactly a factor exp(+-0.05) on every scale
        for n, now in seen[k].items():
            ratio = now / seen[k - 1][n]
            assert bool((ratio > 0.8).all() and (ratio < 1.25).all()), (k, n, ratio)  # a share of itself
    assert all(bool((p > 100 * EPS).all()) for p in seen[12].values())
    resumed, _, resumed_opt = fresh()
    load_checkpoint(resumed, resumed_opt, ckpt)
    train_steps(resumed, resumed_opt, data[5:])
    assert_same_state(model, resumed)
    manager.finalize(model)  # no scale at the floor: nothing said
