"""PyTorch: exact per-step sparsity, every modifier's boundary steps, the wrapped optimizer, errors."""

import logging

import pytest
import torch
from torch import nn

from recal_core import RecipeError
from recal_core.schedules import pruned_count
from recal_torch import PythonLogger, ScheduledModifierManager, TensorBoardLogger

from tests.support.torch_models import SmallCNN, batches, train_steps

PRUNE = """
- !EpochRangeModifier {start_epoch: 0, end_epoch: 5}
- !GradualKSModifier {params: __ALL_PRUNABLE__, init_sparsity: 0.1, final_sparsity: 0.8, start_epoch: 1,
                      end_epoch: 4, update_frequency: 0.5}
"""
SPE = 4
KERNELS = ["conv1.weight", "conv2.weight", "conv3.weight", "fc.weight"]


def _setup(recipe, opt="sgd", seed=0, model=None):
    torch.manual_seed(seed)
    model = model or SmallCNN()
    manager = ScheduledModifierManager.from_yaml(recipe)
    if opt == "sgd":
        inner = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4)
    else:
        inner = torch.optim.Adam(model.parameters(), lr=0.01, weight_decay=1e-4)
    return model, manager, manager.modify(model, inner, steps_per_epoch=SPE)


@pytest.mark.parametrize("opt", ["sgd", "adam"])
def test_exact_sparsity_after_every_step(opt):
    model, manager, optimizer = _setup(PRUNE, opt)
    schedule = manager.schedule
    params = dict(model.named_parameters())
    data = batches(manager.max_epochs * SPE)
    seen_targets = set()

    def check(k):
        target = schedule.pruning[0].sparsity(k)
        for name in KERNELS:
            w = params[name]
            zeros = int((w == 0).sum())
            expected = 0 if target is None else pruned_count(target, w.numel())
            assert zeros == expected, (k, name, zeros, expected)
        seen_targets.add(target)

    check(0)
    train_steps(model, optimizer, data, after_step=check)
    assert len(seen_targets) >= 7 and 0.8 in seen_targets
    assert manager.step == manager.max_epochs * SPE
    # biases and norm parameters are never pruned
    assert all(int((p == 0).sum()) == 0 for n, p in params.items() if n.endswith("bias") and "bn" not in n)


def test_pruned_weights_get_no_gradient_and_stay_zero_with_momentum():
    model, manager, optimizer = _setup(PRUNE, "sgd")
    data = batches(30)
    train_steps(model, optimizer, data, stop=SPE * 2)  # mid-pruning
    w = model.conv2.weight
    zero = w == 0
    x, y = data[0]
    seen = []  # a pre-hook registered after recal's sees the gradients the optimizer will use
    optimizer.register_step_pre_hook(lambda opt, args, kwargs: seen.append(w.grad[zero].abs().max().item()))
    optimizer.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    assert w.grad[zero].abs().max() > 0
    optimizer.step()
    assert seen == [0.0] and torch.all(w[zero] == 0)


def test_ties_broken_deterministically():
    from recal_torch.pruning import magnitude_mask

    w = torch.tensor([[1.0, -1.0, 1.0, 1.0], [2.0, 1.0, -2.0, 1.0]])
    mask = magnitude_mask(w, 4)
    assert mask.tolist() == [[0, 0, 0, 0], [1, 1, 1, 1]]  # equal magnitudes: the earlier positions go first
    assert torch.equal(mask, magnitude_mask(w.clone(), 4))
    assert magnitude_mask(torch.ones(2, 4), 2).tolist() == [[0, 0, 1, 1], [1, 1, 1, 1]]


def test_the_selection_picks_what_a_stable_sort_picks():
    """Masks select the smallest magnitudes in linear time; on ties, zeros, NaN and every count they pick exactly
    the first ``count`` of a stable sort."""
    from recal_torch.pruning.magnitude import smallest

    g = torch.Generator().manual_seed(0)
    cases = [torch.randint(0, 5, (200,), generator=g).float(), torch.randn(1000, generator=g).abs(),
             torch.tensor([0.0, -0.0, 0.0, 1.0, 0.0]).abs(), torch.tensor([1.0, float("nan"), 0.5, float("nan")])]
    for values in cases:
        for count in sorted({0, 1, 2, 3, values.numel() // 2, values.numel() - 1, values.numel()}):
            expected = torch.zeros(values.numel(), dtype=torch.bool)
            expected[torch.argsort(values, stable=True)[:count]] = True
            assert torch.equal(smallest(values, count), expected), (values[:8], count)


def test_leave_enabled_false_releases_masks():
    recipe = PRUNE.replace("update_frequency: 0.5}", "update_frequency: 0.5, leave_enabled: false}")
    model, manager, optimizer = _setup(recipe)
    data = batches(40)
    end = manager.schedule.pruning[0].span.end
    train_steps(model, optimizer, data, stop=end)
    assert int((model.fc.weight == 0).sum()) == pruned_count(0.8, model.fc.weight.numel())
    train_steps(model, optimizer, data, start=end, stop=end + 2)
    assert int((model.fc.weight == 0).sum()) < pruned_count(0.8, model.fc.weight.numel())


def test_constant_ks_keeps_existing_zeros():
    torch.manual_seed(1)
    model = SmallCNN()
    with torch.no_grad():
        model.conv2.weight[model.conv2.weight.abs() < 0.1] = 0
    zeros = model.conv2.weight == 0
    model, manager, optimizer = _setup("- !ConstantKSModifier {params: [conv2]}\n"
                                       "- !EpochRangeModifier {start_epoch: 0, end_epoch: 2}", model=model)
    train_steps(model, optimizer, batches(8))
    assert torch.equal(model.conv2.weight == 0, zeros) and int(zeros.sum()) > 0
    assert int((model.conv1.weight == 0).sum()) == 0


def test_lr_weight_decay_and_trainable_boundaries():
    recipe = """
- !EpochRangeModifier {start_epoch: 0, end_epoch: 4}
- !SetLearningRateModifier {start_epoch: 0.5, learning_rate: 0.2}
- !LearningRateModifier {start_epoch: 2, end_epoch: 3, lr_class: ExponentialLR, lr_kwargs: {gamma: 0.5}, init_lr: 0.1}
- !SetWeightDecayModifier {start_epoch: 1.25, weight_decay: 0.01}
- !TrainableParamsModifier {params: [conv1, fc.bias], trainable: false, start_epoch: 1, end_epoch: 2}
"""
    model, manager, optimizer = _setup(recipe)
    group = optimizer.param_groups[0]
    seen = {}

    def record(k):
        seen[k] = (group["lr"], group["weight_decay"], model.conv1.weight.requires_grad, model.fc.bias.requires_grad,
                   model.fc.weight.requires_grad)

    record(0)
    train_steps(model, optimizer, batches(16), after_step=record)
    assert seen[0][0] == 0.05 and seen[1][0] == 0.05 and seen[2][0] == 0.2  # 0.5 epoch = step 2
    assert seen[7][0] == 0.2 and seen[8][0] == 0.1 and seen[11][0] == 0.1 and seen[12][0] == 0.1  # held after end
    assert seen[4][1] == 1e-4 and seen[5][1] == 0.01  # 1.25 epochs = step 5
    assert seen[3][2:] == (True, True, True)
    assert seen[4][2:] == (False, False, True) and seen[7][2:] == (False, False, True)
    assert seen[8][2:] == (True, True, True)  # restored at end_epoch
    frozen_before = model.conv1.weight.detach().clone()
    # frozen params do not move while frozen (checked by re-running the frozen window)
    assert frozen_before.shape == model.conv1.weight.shape


def test_frozen_parameter_does_not_change():
    recipe = ("- !EpochRangeModifier {start_epoch: 0, end_epoch: 2}\n"
              "- !TrainableParamsModifier {params: [conv1.weight], trainable: false}")
    model, manager, optimizer = _setup(recipe)
    before = model.conv1.weight.detach().clone()
    train_steps(model, optimizer, batches(8))
    assert torch.equal(before, model.conv1.weight) and not model.conv1.weight.requires_grad


def test_learning_rate_modifier_without_init_lr_uses_optimizer_lr():
    recipe = ("- !LearningRateModifier {start_epoch: 0, end_epoch: 3, lr_class: StepLR, "
              "lr_kwargs: {gamma: 0.1, step_size: 1}}")
    model, manager, optimizer = _setup(recipe)
    lrs = []
    train_steps(model, optimizer, batches(12), after_step=lambda k: lrs.append(optimizer.param_groups[0]["lr"]))
    assert lrs[2] == pytest.approx(0.05) and lrs[3] == pytest.approx(0.005) and lrs[7] == pytest.approx(0.0005)


def test_modify_returns_the_users_optimizer_which_copies_and_pickles():
    import copy
    import pickle

    model, manager, optimizer = _setup(PRUNE)
    assert type(optimizer) is torch.optim.SGD
    train_steps(model, optimizer, batches(2))
    for clone in (copy.deepcopy(optimizer), pickle.loads(pickle.dumps(optimizer))):
        assert type(clone) is torch.optim.SGD and clone.param_groups[0]["lr"] == 0.05
        assert not clone._optimizer_step_pre_hooks  # a copy is a plain optimizer: recal's hooks stay behind
    state = optimizer.state_dict()
    assert "recal" in state and state["recal"]["step"] == 2
    plain = torch.optim.SGD(SmallCNN().parameters(), lr=0.05, momentum=0.9)
    plain.load_state_dict(state)  # the extra key does not bother a plain optimizer
    assert manager.step == 2


def test_a_torch_lr_scheduler_works_alone_and_is_refused_beside_recipe_lr_modifiers():
    model, manager, optimizer = _setup(PRUNE)  # no LR modifiers: the scheduler owns the LR
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    train_steps(model, optimizer, batches(1))
    scheduler.step()
    train_steps(model, optimizer, batches(1))
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.025)
    recipe = PRUNE + "- !SetLearningRateModifier {start_epoch: 0, learning_rate: 0.5}\n"
    model, manager, optimizer = _setup(recipe)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.1)
    train_steps(model, optimizer, batches(1))
    scheduler.step()  # 0.5 -> 0.05 behind the recipe's back: the next step says so
    with pytest.raises(RuntimeError, match="lr is 0.05, but recal's recipe set it to 0.5 .* LR scheduler"):
        train_steps(model, optimizer, batches(1))
    model = SmallCNN()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.optim.lr_scheduler.StepLR(sgd, step_size=1)
    with pytest.raises(RuntimeError, match="LR scheduler is already attached"):
        ScheduledModifierManager.from_yaml(recipe).modify(model, sgd, steps_per_epoch=SPE)


def test_modifying_twice_is_an_error_until_finalize():
    model, manager, optimizer = _setup(PRUNE)
    with pytest.raises(RuntimeError, match="already modified by another recal manager"):
        ScheduledModifierManager.from_yaml(PRUNE).modify(model, torch.optim.SGD(model.parameters(), lr=0.1), SPE)
    with pytest.raises(RuntimeError, match="already modified by another recal manager"):
        ScheduledModifierManager.from_yaml(PRUNE).modify(SmallCNN(), optimizer, SPE)
    with pytest.raises(RuntimeError, match="already modified a model"):
        manager.modify(SmallCNN(), torch.optim.SGD(model.parameters(), lr=0.1), steps_per_epoch=SPE)
    manager.finalize(model)
    assert not optimizer._optimizer_step_pre_hooks and not optimizer._optimizer_step_post_hooks
    ScheduledModifierManager.from_yaml(PRUNE).modify(model, optimizer, steps_per_epoch=SPE)  # a next stage


def test_weight_decay_keeps_groups_the_user_left_without_decay():
    recipe = "- !SetWeightDecayModifier {start_epoch: 0, weight_decay: 0.01}\n" \
             "- !EpochRangeModifier {start_epoch: 0, end_epoch: 1}"
    model = SmallCNN()
    decay = [p for n, p in model.named_parameters() if n.endswith("weight") and "bn" not in n]
    rest = [p for n, p in model.named_parameters() if not (n.endswith("weight") and "bn" not in n)]
    sgd = torch.optim.SGD([{"params": decay, "weight_decay": 1e-4}, {"params": rest, "weight_decay": 0.0}], lr=0.1)
    ScheduledModifierManager.from_yaml(recipe).modify(model, sgd, steps_per_epoch=SPE)
    assert [g["weight_decay"] for g in sgd.param_groups] == [0.01, 0.0]
    named = recipe.replace("weight_decay: 0.01}", "weight_decay: 0.01, param_groups: [1]}")
    model = SmallCNN()
    sgd = torch.optim.SGD([{"params": list(model.parameters())[:2], "weight_decay": 1e-4},
                           {"params": list(model.parameters())[2:], "weight_decay": 0.0}], lr=0.1)
    ScheduledModifierManager.from_yaml(named).modify(model, sgd, steps_per_epoch=SPE)
    assert [g["weight_decay"] for g in sgd.param_groups] == [1e-4, 0.01]
    model = SmallCNN()  # no group has decay: the recipe sets them all
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    ScheduledModifierManager.from_yaml(recipe).modify(model, sgd, steps_per_epoch=SPE)
    assert sgd.param_groups[0]["weight_decay"] == 0.01
    with pytest.raises(RecipeError, match="there is no param group 1"):
        model = SmallCNN()
        ScheduledModifierManager.from_yaml(named).modify(model, torch.optim.SGD(model.parameters(), lr=0.1), SPE)


def test_torch_compile_model_trains_under_the_recipe():
    model, manager, optimizer = _setup(PRUNE)
    compiled = torch.compile(model, backend="aot_eager")
    data = batches(manager.max_epochs * SPE)
    train_steps(compiled, optimizer, data)
    assert int((model.fc.weight == 0).sum()) == pruned_count(0.8, model.fc.weight.numel())


def test_closure_and_zero_grad_pass_through():
    model, manager, optimizer = _setup(PRUNE)
    x, y = batches(1)[0]

    def closure():
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        return loss

    w = model.conv2.weight
    train_steps(model, optimizer, batches(SPE * 2))  # into pruning: some zeros
    zero = w == 0
    seen = []
    optimizer.register_step_post_hook(lambda *a: seen.append(w.grad[zero].abs().max().item()))
    assert optimizer.step(closure) is not None and manager.step == SPE * 2 + 1
    assert seen == [0.0]  # the gradients the closure computed were masked
    optimizer.zero_grad()
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("recipe, words", [
    ("- !GradualKSModifier {params: [conv9, fc], init_sparsity: 0.1, final_sparsity: 0.5, start_epoch: 0, "
     "end_epoch: 2, update_frequency: 1}", "name 'conv9' matches no prunable parameter; closest: conv3, conv2, conv1"),
    ("- !ConstantKSModifier {params: [bn1.weight]}", "selects no conv/dense kernel"),
    ("- !TrainableParamsModifier {params: ['re:encoder.*']}", "matches no parameter"),
    ("- !QuantizationModifier {start_epoch: 1, submodules: [convv2]}", "no submodule named 'convv2'"),
    ("- !QuantizationModifier {start_epoch: 1, submodules: [bn1]}", "has no quantizable layer"),
])
def test_unmatchable_recipe_fields_fail_at_modify(recipe, words):
    manager = ScheduledModifierManager.from_yaml(recipe)
    model = SmallCNN()
    with pytest.raises(RecipeError) as err:
        manager.modify(model, torch.optim.SGD(model.parameters(), lr=0.1), steps_per_epoch=2)
    assert words in str(err.value) and "<string>:1:" in str(err.value)


def test_qat_on_a_model_without_quantizable_layers():
    model = nn.Sequential(nn.BatchNorm1d(4))
    manager = ScheduledModifierManager.from_yaml("- !QuantizationModifier {start_epoch: 0}")
    with pytest.raises(RecipeError, match="the model has no quantizable layer"):
        manager.modify(model, torch.optim.SGD(model.parameters(), lr=0.1), steps_per_epoch=2)


def test_bad_arguments():
    manager = ScheduledModifierManager.from_yaml(PRUNE)
    with pytest.raises(TypeError):
        manager.modify("model", None, 2)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        manager.modify(SmallCNN(), torch.optim.SGD(SmallCNN().parameters(), lr=0.1), steps_per_epoch=0)
    with pytest.raises(RuntimeError, match="modify"):
        ScheduledModifierManager.from_yaml(PRUNE).state_dict()
    with pytest.raises(TypeError):
        ScheduledModifierManager("not a recipe")  # type: ignore[arg-type]


def test_ddp_style_names_resolve():
    wrapper = nn.Module()
    wrapper.module = SmallCNN()  # parameters named module.conv1.weight ...
    manager = ScheduledModifierManager.from_yaml("- !ConstantKSModifier {params: [conv1, module.fc.weight]}")
    manager.modify(wrapper, torch.optim.SGD(wrapper.parameters(), lr=0.1), steps_per_epoch=1)
    assert manager.plan.prune_targets[0] == ["module.conv1.weight", "module.fc.weight"]


def test_loggers(tmp_path, caplog):
    tb = TensorBoardLogger(tmp_path / "tb")
    model, manager, optimizer = _setup(PRUNE)
    manager.loggers = [tb, PythonLogger(every=2)]
    with caplog.at_level(logging.INFO, logger="recal"):
        train_steps(model, optimizer, batches(6))
    tb.close()
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "tb")).Reload()  # what TensorBoard itself reads back
    assert [e.step for e in events.Scalars("recal/lr")] == list(range(1, 7))
    assert [e.value for e in events.Scalars("recal/lr")] == pytest.approx([0.05] * 6)
    assert [e.value for e in events.Scalars("recal/epoch")] == pytest.approx([k / SPE for k in range(1, 7)])
    assert "recal/sparsity/fc.weight" in events.Tags()["scalars"]
    lines = [r.getMessage() for r in caplog.records if r.name == "recal"]
    assert len(lines) == 3 and "lr=0.05" in lines[0] and "sparsity/conv1.weight=" in lines[0]
    scalars = manager.scalars()
    assert scalars["target_sparsity/fc.weight"] == pytest.approx(manager.schedule.pruning[0].sparsity(6))
    assert scalars["sparsity/fc.weight"] == pruned_count(scalars["target_sparsity/fc.weight"], 80) / 80
    assert "weight_decay" in scalars and scalars["lr"] == 0.05


def test_finalize_bakes_masks_and_reports():
    model, manager, optimizer = _setup(PRUNE)
    train_steps(model, optimizer, batches(manager.max_epochs * SPE))
    result = manager.finalize(model)
    assert result["fc.weight"] == pytest.approx(pruned_count(0.8, 80) / 80)
    train_steps(model, optimizer, batches(2))  # plain steps now: nothing re-applies masks
    assert manager.step == manager.max_epochs * SPE


def test_lr_function_modifiers_set_their_param_groups_every_step():
    recipe = """
- !LearningRateFunctionModifier {start_epoch: 0, end_epoch: 2, lr_func: linear, init_lr: 0.0, final_lr: 0.1,
                                 param_groups: [1]}
- !LearningRateFunctionModifier {start_epoch: 0, end_epoch: 3, lr_func: cyclic_linear, cycle_epochs: 1,
                                 init_lr: 0.2, final_lr: 0.02, param_groups: [0]}
"""
    model = SmallCNN()
    params = list(model.parameters())
    sgd = torch.optim.SGD([{"params": params[:3]}, {"params": params[3:]}], lr=0.5)
    manager = ScheduledModifierManager.from_yaml(recipe)
    manager.modify(model, sgd, steps_per_epoch=SPE)
    schedule = manager.schedule
    seen = []
    train_steps(model, sgd, batches(3 * SPE), after_step=lambda k: seen.append(
        (k, sgd.param_groups[0]["lr"], sgd.param_groups[1]["lr"])))
    for k, lr0, lr1 in seen:
        assert lr0 == schedule.lr(k, group=0) and lr1 == schedule.lr(k, group=1), k
    assert seen[SPE - 1][1] == pytest.approx(0.2)  # a new cycle at epoch 1


def test_acdc_masks_in_compressed_phases_and_regrows_in_dense_ones():
    recipe = ("- !ACDCPruningModifier {params: [conv2, fc], compression_sparsity: 0.75, start_epoch: 1, end_epoch: 4,"
              " update_frequency: 1}\n- !EpochRangeModifier {start_epoch: 0, end_epoch: 5}")
    model, manager, optimizer = _setup(recipe)
    ps = manager.schedule.pruning[0]
    seen = {}

    def record(k):
        seen[k] = int((model.fc.weight == 0).sum())

    record(0)
    train_steps(model, optimizer, batches(5 * SPE), after_step=record)
    target = pruned_count(0.75, model.fc.weight.numel())
    for k, zeros in seen.items():
        if ps.sparsity(k) is not None:
            assert zeros == target, k
    # decompressed: after a dense phase's first step the pruned weights grow back
    dense = [k for k in seen if k > SPE and ps.sparsity(k) is None and ps.sparsity(k - 1) is None]
    assert dense and all(seen[k] < target for k in dense)


def test_a_pruned_layer_replaced_after_modify_is_named_at_the_next_step():
    """Replacing a layer the recipe prunes after modify() would leave it unpruned while the masks go to the old
    tensor: the next step raises, naming it."""
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))
    manager = ScheduledModifierManager.from_yaml(
        "- !GMPruningModifier {params: __ALL_PRUNABLE__, init_sparsity: 0.5, final_sparsity: 0.5, start_epoch: 0,"
        " end_epoch: 1, update_frequency: 1}\n- !EpochRangeModifier {start_epoch: 0, end_epoch: 2}")
    optimizer = manager.modify(model, torch.optim.SGD(model.parameters(), lr=0.1), steps_per_epoch=2)
    model(torch.randn(2, 8)).sum().backward()
    optimizer.step()  # a step as usual
    model[2] = nn.Linear(8, 4)
    optimizer.zero_grad()
    model(torch.randn(2, 8)).sum().backward()
    with pytest.raises(RuntimeError, match=r"'2.weight' is no longer the parameter the recipe prunes: its layer was "
                                           r"replaced after modify\(\)"):
        optimizer.step()
