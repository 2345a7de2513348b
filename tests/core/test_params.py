"""Parameter selection: __ALL__, __ALL_PRUNABLE__, names, layer names, re:, DDP prefix, helpful errors."""

import pytest

from recal_core import RecipeError, load_recipe
from recal_core.params import ParamInfo, resolve_params, select

PARAMS = [
    ParamInfo("conv1.weight", "conv1", True), ParamInfo("conv1.bias", "conv1", False),
    ParamInfo("bn1.weight", "bn1", False), ParamInfo("bn1.bias", "bn1", False),
    ParamInfo("blocks.0.conv.weight", "blocks.0.conv", True),
    ParamInfo("blocks.1.conv.weight", "blocks.1.conv", True),
    ParamInfo("fc.weight", "fc", True), ParamInfo("fc.bias", "fc", False),
]


def names(spec, pruning=True):
    hits, failures = select(spec, PARAMS, pruning=pruning)
    assert not failures, failures
    return [p.name for p in hits]


def test_all_and_all_prunable():
    kernels = ["conv1.weight", "blocks.0.conv.weight", "blocks.1.conv.weight", "fc.weight"]
    assert names("__ALL__") == kernels == names("__ALL_PRUNABLE__") == names("__ALL_PRUNABLE__", False)
    assert names("__ALL__", pruning=False) == [p.name for p in PARAMS]


def test_names_layers_and_regex():
    assert names(["blocks.1.conv"]) == ["blocks.1.conv.weight"]
    assert names(["blocks.1.conv"], pruning=False) == ["blocks.1.conv.weight"]
    assert names(["fc"], pruning=False) == ["fc.weight", "fc.bias"]
    assert names("re:.*conv") == ["blocks.0.conv.weight", "blocks.1.conv.weight"]
    assert names(["re:blocks\\.\\d\\.conv\\.weight", "fc.weight"]) == [
        "blocks.0.conv.weight", "blocks.1.conv.weight", "fc.weight"]


def test_ddp_prefix_ignored_both_ways():
    wrapped = [ParamInfo("module." + p.name, "module." + p.layer, p.prunable) for p in PARAMS]
    hits, failures = select(["fc", "module.conv1.weight"], wrapped, pruning=True)
    assert not failures and [p.name for p in hits] == ["module.conv1.weight", "module.fc.weight"]
    assert [p.name for p in select(["module.fc"], PARAMS, pruning=True)[0]] == ["fc.weight"]


def test_unmatched_names_suggest_closest():
    _, failures = select(["blocks.2.conv", "re:.*attn.*"], PARAMS, pruning=True)
    assert len(failures) == 2
    assert "blocks.0.conv" in failures[0] or "blocks.1.conv" in failures[0]
    assert "pattern 're:.*attn.*' matches no prunable parameter" in failures[1]


def test_pruning_a_bias_is_refused():
    _, failures = select(["fc.bias"], PARAMS, pruning=True)
    assert failures and "no conv/dense kernel" in failures[0]
    _, failures = select(["re:bn1\\..*"], PARAMS, pruning=True)
    assert failures and "no conv/dense kernel" in failures[0]


def test_resolve_params_raises_located_recipe_error():
    recipe = load_recipe("modifiers:\n  - !ConstantKSModifier\n    params: [conv9, fc]\n")
    with pytest.raises(RecipeError) as err:
        resolve_params(recipe, 0, PARAMS, pruning=True)
    text = str(err.value)
    assert "<string>:3:13: !ConstantKSModifier (modifiers[0]), field 'params'" in text and "conv9" in text
    assert [p.name for p in resolve_params(load_recipe("- !ConstantKSModifier {params: [fc]}"), 0, PARAMS,
                                           pruning=True)] == ["fc.weight"]
