"""Every field of every modifier has a failing case, located at that field."""

import pytest

from recal_core.errors import RecipeWarning
from recal_core import RecipeError, load_recipe
from recal_core.modifiers import MODIFIER_TYPES

VALID = {
    "EpochRangeModifier": {"start_epoch": 0, "end_epoch": 5},
    "GradualKSModifier": {"params": "__ALL__", "init_sparsity": 0.05, "final_sparsity": 0.8,
                          "start_epoch": 1, "end_epoch": 4, "update_frequency": 1},
    "ConstantKSModifier": {"params": ["conv1.weight"]},
    "OBSPruningModifier": {"params": "__ALL__", "init_sparsity": 0.5, "final_sparsity": 0.8, "start_epoch": 1,
                           "end_epoch": 4, "update_frequency": 1, "num_grads": 16, "fisher_block_size": 32,
                           "damp": 1e-7, "mask_type": "block4", "global_sparsity": True},
    "MFACPruningModifier": {"params": "__ALL__", "init_sparsity": 0.0, "final_sparsity": 0.8, "start_epoch": 1,
                            "end_epoch": 4, "update_frequency": 1, "num_grads": 16, "fisher_block_size": 32,
                            "damp": 1e-5, "available_gpus": ["cuda:0"]},
    "ACDCPruningModifier": {"params": "__ALL_PRUNABLE__", "compression_sparsity": 0.9, "start_epoch": 0,
                            "end_epoch": 4, "update_frequency": 1},
    "GlobalMagnitudePruningModifier": {"params": "__ALL__", "init_sparsity": 0.05, "final_sparsity": 0.8,
                                       "start_epoch": 1, "end_epoch": 4, "update_frequency": 1},
    "QuantizationModifier": {"start_epoch": 2, "freeze_bn_stats_epoch": 3, "ignore": ["lm_head"],
                             "scheme_overrides": {"ReLU": {"input_activations": None, "output_activations": None}},
                             "disable_quantization_observer_epoch": 4},
    "SetLearningRateModifier": {"start_epoch": 0, "learning_rate": 0.1},
    "LearningRateModifier": {"start_epoch": 0, "end_epoch": 10, "lr_class": "MultiStepLR",
                             "lr_kwargs": {"gamma": 0.1, "milestones": [2, 5]}, "init_lr": 0.1},
    "LearningRateFunctionModifier": {"start_epoch": 1, "end_epoch": 9, "lr_func": "cyclic_linear", "init_lr": 0.1,
                                     "final_lr": 0.01, "cycle_epochs": 2},
    "TrainableParamsModifier": {"params": "re:.*conv.*", "trainable": False, "start_epoch": 0, "end_epoch": 3},
    "SetWeightDecayModifier": {"start_epoch": 1, "weight_decay": 0.0},
    "DistillationModifier": {"start_epoch": 0, "end_epoch": 3, "hardness": 1.0, "temperature": 2.0,
                             "distill_output_keys": ["start_logits", "end_logits"]},
}

# (modifier, field, bad value, words the message must contain)
BAD = [
    ("EpochRangeModifier", "start_epoch", -1, ">= 0"),
    ("EpochRangeModifier", "start_epoch", "zero", "number"),
    ("EpochRangeModifier", "end_epoch", 0, "greater than start_epoch"),
    ("GradualKSModifier", "params", [], "empty"),
    ("GradualKSModifier", "params", ["re:(unclosed"], "invalid regular expression"),
    ("GradualKSModifier", "params", ["__ALL__", "x"], "selects everything"),
    ("GradualKSModifier", "params", 5, "string"),
    ("GradualKSModifier", "init_sparsity", 1.0, "[0, 1)"),
    ("GradualKSModifier", "init_sparsity", -0.1, "[0, 1)"),
    ("GradualKSModifier", "final_sparsity", 0.01, ">= init_sparsity"),
    ("GradualKSModifier", "final_sparsity", 1.5, "[0, 1)"),
    ("GradualKSModifier", "start_epoch", -1, ">= 0"),
    ("GradualKSModifier", "end_epoch", 1, "greater than start_epoch"),
    ("GradualKSModifier", "update_frequency", 0, "> 0"),
    ("GradualKSModifier", "update_frequency", -2, "> 0"),
    ("GradualKSModifier", "inter_func", "quadratic", "linear"),
    ("GradualKSModifier", "leave_enabled", "yes", "bool"),
    ("GradualKSModifier", "mask_type", "diagonal", "is not one recal knows"),
    ("GradualKSModifier", "mask_type", "4:2", "N:M needs 1 <= N <= M"),
    ("GradualKSModifier", "global_sparsity", "yes", "valid boolean"),
    ("GlobalMagnitudePruningModifier", "global_sparsity", False, "not supported"),
    ("GlobalMagnitudePruningModifier", "mask_type", "filter", "global_sparsity ranks single weights"),
    ("GlobalMagnitudePruningModifier", "final_sparsity", 1.0, "[0, 1)"),
    ("GradualKSModifier", "phased", True, "not supported"),
    ("GradualKSModifier", "score_type", "movement", "not supported"),
    ("GradualKSModifier", "final_sparsity", {0.9: ["a"]}, "sparsity -> params mapping names the params itself"),
    ("ConstantKSModifier", "params", "", "empty name"),
    ("ConstantKSModifier", "start_epoch", -2, ">= 0"),
    ("ConstantKSModifier", "end_epoch", -5, ">= 0"),
    ("QuantizationModifier", "start_epoch", -3, ">= 0"),
    ("QuantizationModifier", "submodules", [], "non-empty"),
    ("QuantizationModifier", "ignore", [" "], "non-empty list of module names"),
    ("QuantizationModifier", "scheme_overrides", {"Linear": {"weights": {"num_bits": 3}}}, "8 bits (or weight-only weights to 4 or 2)"),
    ("QuantizationModifier", "scheme_overrides", {"Linear": {"weights": {"group_size": 24}}}, "power of two >= 16"),
    ("QuantizationModifier", "scheme_overrides", {"Linear": {"weights": {"strategy": "group"}}}, "needs a group_size"),
    ("QuantizationModifier", "scheme", "W4A4", "W4A16"),
    ("QuantizationModifier", "scheme", {"weights": {"num_bits": 4, "observer": "histogram"}}, "minmax"),
    ("QuantizationModifier", "freeze_bn_stats_epoch", 1, ">= start_epoch"),
    ("QuantizationModifier", "disable_quantization_observer_epoch", 0.5, ">= start_epoch"),
    ("QuantizationModifier", "reduce_range", "yes", "valid boolean"),
    ("QuantizationModifier", "end_epoch", 10, "cannot be disabled"),
    ("SetLearningRateModifier", "start_epoch", -0.5, ">= 0"),
    ("SetLearningRateModifier", "learning_rate", 0, "greater than 0"),
    ("SetLearningRateModifier", "end_epoch", 3, "not supported"),
    ("SetLearningRateModifier", "constant_logging", "on", "bool"),
    ("SetLearningRateModifier", "param_groups", [], "non-empty"),
    ("LearningRateFunctionModifier", "lr_func", "exponential", "'linear', 'cosine' or 'cyclic_linear'"),
    ("LearningRateFunctionModifier", "init_lr", -1, "greater than or equal to 0"),
    ("LearningRateFunctionModifier", "final_lr", "low", "valid number"),
    ("LearningRateFunctionModifier", "start_epoch", -1, ">= 0"),
    ("LearningRateFunctionModifier", "end_epoch", 1, "greater than start_epoch"),
    ("LearningRateFunctionModifier", "cycle_epochs", 0, "> 0 epochs"),
    ("LearningRateFunctionModifier", "param_groups", [1, 1], "distinct"),
    ("LearningRateFunctionModifier", "update_frequency", 1, "not supported"),
    ("LearningRateModifier", "start_epoch", -4, ">= 0"),
    ("LearningRateModifier", "end_epoch", 0, "greater than start_epoch"),
    ("LearningRateModifier", "lr_class", "CyclicLR", "ExponentialLR, StepLR, MultiStepLR, CosineAnnealingWarmRestarts"),
    ("LearningRateModifier", "lr_kwargs", {"gamma": 0.1}, "missing 'milestones'"),
    ("LearningRateModifier", "lr_kwargs", {"gamma": 0.1, "milestones": [2, 12]}, "outside"),
    ("LearningRateModifier", "lr_kwargs", {"gamma": 0.1, "milestones": [5, 2]}, "strictly increasing"),
    ("LearningRateModifier", "lr_kwargs", {"gamma": -1, "milestones": [2]}, "gamma must be > 0"),
    ("LearningRateModifier", "lr_kwargs", {"gamma": 0.1, "milestones": [2], "eta": 1}, "unknown 'eta'"),
    ("LearningRateModifier", "init_lr", -0.1, "greater than 0"),
    ("LearningRateModifier", "update_frequency", 1, "not supported"),
    ("LearningRateModifier", "constant_logging", 2, "bool"),
    ("TrainableParamsModifier", "params", [], "empty"),
    ("TrainableParamsModifier", "trainable", "no", "bool"),
    ("TrainableParamsModifier", "params_strict", False, "not supported"),
    ("TrainableParamsModifier", "start_epoch", -7, ">= 0"),
    ("TrainableParamsModifier", "end_epoch", 0, "greater than start_epoch"),
    ("SetWeightDecayModifier", "start_epoch", -9, ">= 0"),
    ("SetWeightDecayModifier", "weight_decay", -0.1, "greater than or equal to 0"),
    ("SetWeightDecayModifier", "param_groups", [0, 0], "distinct param-group indices"),
    ("SetWeightDecayModifier", "param_groups", [-1], "greater than or equal to 0"),
    ("SetWeightDecayModifier", "end_epoch", 4, "not supported"),
    ("SetWeightDecayModifier", "constant_logging", "x", "bool"),
    ("MFACPruningModifier", "num_grads", 5000, "less than or equal to 4096"),
    ("MFACPruningModifier", "fisher_block_size", 0, "greater than or equal to 1"),
    ("MFACPruningModifier", "damp", -1.0, "greater than 0"),
    ("MFACPruningModifier", "available_gpus", 3, "valid tuple"),
    ("MFACPruningModifier", "mask_type", "block4", "not supported"),
    ("OBSPruningModifier", "num_grads", 0, "greater than or equal to 1"),
    ("OBSPruningModifier", "fisher_block_size", 30, "multiple of the mask's block of 4"),
    ("OBSPruningModifier", "damp", 0, "greater than 0"),
    ("OBSPruningModifier", "grad_sampler_kwargs", "big", "valid dictionary"),
    ("OBSPruningModifier", "num_recomputations", 2, "not supported"),
    ("OBSPruningModifier", "mask_type", "filter", "OBS prunes single weights or blocks of 4"),
    ("ACDCPruningModifier", "params", [], "empty"),
    ("ACDCPruningModifier", "compression_sparsity", 1.0, "less than 1"),
    ("ACDCPruningModifier", "start_epoch", -1, ">= 0"),
    ("ACDCPruningModifier", "end_epoch", 0, "greater than start_epoch"),
    ("ACDCPruningModifier", "update_frequency", 0, "greater than 0"),
    ("ACDCPruningModifier", "global_sparsity", "no", "valid boolean"),
    ("ACDCPruningModifier", "leave_enabled", 3, "valid boolean"),
    ("ACDCPruningModifier", "mask_type", "filter", "AC/DC masks single weights"),
    ("DistillationModifier", "start_epoch", -2, ">= 0"),
    ("DistillationModifier", "end_epoch", 0, "greater than start_epoch"),
    ("DistillationModifier", "hardness", 1.5, "less than or equal to 1"),
    ("DistillationModifier", "temperature", 0, "greater than 0"),
    ("DistillationModifier", "distill_output_keys", [], "non-empty"),
    ("DistillationModifier", "update_frequency", 1, "not supported"),
] + [(tag, "log_types", 3, "string") for tag in sorted(VALID)]


def _recipe(tag: str, fields: dict) -> str:
    import yaml

    body = yaml.safe_dump(fields, default_flow_style=False, sort_keys=False)
    return f"modifiers:\n  - !{tag}\n" + "".join(f"    {line}\n" for line in body.splitlines())


@pytest.mark.parametrize("tag", sorted(VALID))
def test_valid_baselines_load(tag):
    load_recipe(_recipe(tag, VALID[tag]))


@pytest.mark.parametrize("tag, field, value, words", BAD, ids=[f"{t}.{f}={v!r}" for t, f, v, _ in BAD])
def test_bad_field_is_a_located_error(tag, field, value, words):
    fields = dict(VALID[tag], **{field: value})
    text = _recipe(tag, fields)
    with pytest.raises(RecipeError) as err:
        load_recipe(text)
    problems = [p for p in err.value.problems if p.field == field]
    assert problems, str(err.value)
    line = next(i for i, row in enumerate(text.splitlines(), 1) if row.strip().startswith(f"{field}:"))
    assert problems[0].location.line in (line, line + 1), str(err.value)
    assert words in str(err.value), str(err.value)
    assert f"!{tag} (modifiers[0])" in str(err.value)


def test_every_field_of_every_modifier_has_a_failing_case():
    covered = {(t, f) for t, f, _, _ in BAD}
    for cls in MODIFIER_TYPES:
        own = cls.model_fields
        if cls.__base__ is not None and cls.__base__.__name__ == "GradualKSModifier":
            # fields it inherits unchanged are covered by the parent's cases (the same validators)
            parent = cls.__base__.model_fields
            own = {n: f for n, f in own.items()
                   if n not in parent or (f.annotation, f.default) != (parent[n].annotation, parent[n].default)}
        for name in own:
            assert (cls.tag, name) in covered, f"no failing case for {cls.tag}.{name}"


@pytest.mark.parametrize("tag", sorted(VALID))
def test_unknown_field_lists_the_known_ones(tag):
    with pytest.raises(RecipeError) as err:
        load_recipe(_recipe(tag, dict(VALID[tag], typo_field=1)))
    assert "field 'typo_field': unknown field" in str(err.value)


@pytest.mark.parametrize("tag", sorted(VALID))
def test_missing_required_fields(tag):
    cls = next(c for c in MODIFIER_TYPES if c.tag == tag)
    required = [n for n, f in cls.model_fields.items() if f.is_required() and n not in cls.warned_defaults]
    for name in required:
        fields = {k: v for k, v in VALID[tag].items() if k != name}
        with pytest.raises(RecipeError, match=f"required field '{name}' is missing"):
            load_recipe(_recipe(tag, fields))


@pytest.mark.parametrize("tag", sorted(t for t, c in ((c.tag, c) for c in MODIFIER_TYPES) if c.warned_defaults))
def test_a_field_taken_by_default_is_warned_with_its_place(tag):
    cls = next(c for c in MODIFIER_TYPES if c.tag == tag)
    for name, (value, _) in cls.warned_defaults.items():
        fields = {k: v for k, v in VALID[tag].items() if k not in (name, "freeze_bn_stats_epoch")}
        with pytest.warns(RecipeWarning, match=rf"<string>:\d+:\d+: !{tag}.*{name}"):
            recipe = load_recipe(_recipe(tag, fields))
        assert getattr(recipe.modifiers[0], name) == value


def test_step_size_is_accepted_for_step():
    r = load_recipe(_recipe("LearningRateModifier", {"start_epoch": 0, "end_epoch": 4, "lr_class": "StepLR",
                                                     "lr_kwargs": {"gamma": 0.5, "step_size": 2}}))
    assert r.modifiers[0].lr_kwargs == {"gamma": 0.5, "step": 2.0}
