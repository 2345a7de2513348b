"""The core's combination rules (recal_core.model_plan), which every backend applies as they are."""

import ast
from pathlib import Path

import pytest
from pydantic import ValidationError

from recal_core import QuantizationModifier, Recipe, RecipeError, load_recipe
from recal_core.model_plan import MaskUpdate, plan_model
from recal_core.params import ParamInfo

PARAMS = [ParamInfo("conv.weight", "conv", True), ParamInfo("conv.bias", "conv", False),
          ParamInfo("fc.weight", "fc", True), ParamInfo("fc.bias", "fc", False)]
SIZES = {"conv.weight": 100, "conv.bias": 4, "fc.weight": 40, "fc.bias": 10}


def _plan(text, steps_per_epoch=2, **kw):
    return plan_model(load_recipe(text).bind(steps_per_epoch), PARAMS, SIZES, **kw)


def test_masks_of_several_modifiers_combine_and_update_at_their_steps():
    plan = _plan("""
- !GradualKSModifier {params: [conv], init_sparsity: 0.2, final_sparsity: 0.6, start_epoch: 1, end_epoch: 3,
                      update_frequency: 1, inter_func: linear}
- !ConstantKSModifier {params: __ALL_PRUNABLE__, start_epoch: 0, end_epoch: 4}
""")
    conv, fc = plan.masks["conv.weight"], plan.masks["fc.weight"]
    assert list(plan.masks) == ["conv.weight", "fc.weight"]
    assert conv.in_force(0) == (1,) and conv.in_force(2) == (0, 1) and fc.in_force(2) == (1,)
    assert conv.updates(0) == (MaskUpdate(1, None),)  # ConstantKS keeps the zeros of its start
    assert conv.updates(1) == ()
    assert conv.updates(2) == (MaskUpdate(0, 20),) and conv.updates(4) == (MaskUpdate(0, 40),)
    assert conv.updates(6) == (MaskUpdate(0, 60),) and conv.in_force(8) == (0,)  # ConstantKS ended


def test_trainable_set_at_each_step():
    plan = _plan("""
- !TrainableParamsModifier {params: [fc], trainable: false, start_epoch: 1, end_epoch: 3}
- !TrainableParamsModifier {params: [fc.bias], trainable: true, start_epoch: 2, end_epoch: 3}
""")
    original = {"fc.weight": True, "fc.bias": True}
    assert plan.trainable(0, original) == original
    assert plan.trainable(2, original) == {"fc.weight": False, "fc.bias": False}
    assert plan.trainable(4, original) == {"fc.weight": False, "fc.bias": True}  # the later start wins
    assert plan.trainable(6, original) == original and plan.trainable_rules(6) == ()


def test_group_lr_and_weight_decay_functions():
    text = """
- !LearningRateModifier {start_epoch: 1, end_epoch: 3, lr_class: StepLR, lr_kwargs: {gamma: 0.5, step: 1}}
- !SetWeightDecayModifier {start_epoch: 0, weight_decay: 0.01}
- !SetWeightDecayModifier {start_epoch: 2, weight_decay: 0.02, param_groups: [1]}
"""
    plan = _plan(text, groups=[(0.1, 1e-4), (0.4, 0.0)])
    lr0, lr1 = plan.groups[0].lr, plan.groups[1].lr
    assert (lr0(1), lr0(2), lr0(4)) == (None, 0.1, 0.05) and lr1(2) == 0.4
    wd0, wd1 = plan.groups[0].weight_decay, plan.groups[1].weight_decay
    assert (wd0(0), wd0(5)) == (0.01, 0.01)
    assert (wd1(0), wd1(4)) == (None, 0.02)  # a group without decay is set only when named
    with pytest.raises(RecipeError, match="field 'init_lr': no init_lr"):
        _plan(text, groups=[(None, None)])
    with pytest.raises(RecipeError, match="there is no param group 1"):
        _plan(text, groups=[(0.1, 0.0)])


def test_every_unresolved_name_at_once():
    with pytest.raises(RecipeError) as err:
        _plan("""
- !GradualKSModifier {params: [cnv], init_sparsity: 0.2, final_sparsity: 0.6, start_epoch: 1, end_epoch: 3,
                      update_frequency: 1}
- !TrainableParamsModifier {params: [fx]}
""")
    assert len(err.value.problems) == 2


def test_cross_modifier_rules_hold_however_a_recipe_is_built():
    with pytest.raises(ValidationError, match="a second QuantizationModifier over the whole model"):
        Recipe(modifiers=(QuantizationModifier(start_epoch=0), QuantizationModifier(start_epoch=1)))
    with pytest.raises(RecipeError, match=r"<string>:2:3: .*a second QuantizationModifier"):
        load_recipe("- !QuantizationModifier {start_epoch: 0}\n- !QuantizationModifier {start_epoch: 1}")


def test_schedule_does_not_import_the_recipe():
    """recipe -> schedule, one way: the schedule module names no recal_core.recipe import."""
    core = Path(__file__).resolve().parents[2] / "recal_core"
    for module in ("schedule.py", "schedules.py", "model_plan.py"):
        tree = ast.parse((core / module).read_text())
        imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        assert "recipe" not in imported, module
