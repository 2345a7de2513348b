"""Loading recipes: formats, tags, positions, all-problems-at-once, safety."""

import pytest
import yaml

from recal_core import (ConstantKSModifier, GradualKSModifier, LearningRateModifier, QuantizationModifier,
                        RecipeError, load_recipe)
from recal_core.recipe import Recipe

from tests.support.paths import RECIPES

SEED = """version: 1.0.0

modifiers:
    - !EpochRangeModifier
        start_epoch: 0.0
        end_epoch: 25.0

    - !GradualKSModifier
        params: __ALL__
        init_sparsity: 0.05
        final_sparsity: 0.8
        start_epoch: 5.0
        end_epoch: 20.0
        update_frequency: 1.0
"""


def test_seed_example_loads_with_defaults():
    r = load_recipe(SEED)
    assert r.version == "1.0.0"
    gks = r.modifiers[1]
    assert isinstance(gks, GradualKSModifier)
    assert (gks.params, gks.init_sparsity, gks.final_sparsity) == ("__ALL__", 0.05, 0.8)
    assert gks.inter_func == "cubic" and gks.leave_enabled is True
    assert r.max_epochs == 25 and r.min_epochs == 0


def test_load_from_path_and_pathlike(tmp_path):
    p = tmp_path / "r.yaml"
    p.write_text(SEED)
    assert load_recipe(str(p)) == load_recipe(p) == load_recipe(SEED)
    assert load_recipe(p).source == str(p)


def test_bare_list_of_modifiers():
    r = load_recipe("- !EpochRangeModifier {start_epoch: 0, end_epoch: 3}\n")
    assert r.max_epochs == 3 and r.version == "1.0.0"


def test_markdown_front_matter_after_html_comment(tmp_path):
    text = "<!--\nlicence\nheader\n-->\n\n---\n" + SEED + "---\n\n# Title\nprose with --- inside\n"
    p = tmp_path / "recipe.md"
    p.write_text(text)
    assert load_recipe(p) == load_recipe(SEED)
    assert load_recipe(text) == load_recipe(SEED)


def test_markdown_positions_count_lines_of_the_file(tmp_path):
    text = "<!-- c -->\n---\nmodifiers:\n  - !EpochRangeModifier\n    start_epoch: 0\n    end_epoch: -3\n---\n"
    p = tmp_path / "r.md"
    p.write_text(text)
    with pytest.raises(RecipeError) as err:
        load_recipe(p)
    assert f"{p}:6:16" in str(err.value)


def test_markdown_without_front_matter_is_an_error(tmp_path):
    p = tmp_path / "r.md"
    p.write_text("# just prose\n")
    with pytest.raises(RecipeError, match="no YAML front matter"):
        load_recipe(p)


def test_anchors_aliases_and_several_modifier_lists():
    r = load_recipe("""
num_epochs: &num_epochs 10
lr: &lr 0.1
training_modifiers:
  - !EpochRangeModifier {start_epoch: 0, end_epoch: *num_epochs}
  - !SetLearningRateModifier {start_epoch: 0, learning_rate: *lr}
pruning_modifiers:
  - !GMPruningModifier
    params: ["re:.*conv"]
    init_sparsity: 0.05
    final_sparsity: 0.5
    start_epoch: 1
    end_epoch: 5
    update_frequency: 1
""")
    assert [m.tag for m in r.modifiers] == ["EpochRangeModifier", "SetLearningRateModifier", "GradualKSModifier"]
    assert r.max_epochs == 10
    assert r.describe(2) == "!GradualKSModifier (pruning_modifiers[0])"


def test_sparseml_aliases_and_framework_prefixes():
    r = load_recipe("""
- !pytorch.GMPruningModifier {params: __ALL__, init_sparsity: 0, final_sparsity: 0.5, start_epoch: 0,
                              end_epoch: 2, update_frequency: 1}
- !tensorflow.ConstantPruningModifier {params: __ALL__}
- !pytorch.QuantizationModifier {start_epoch: 1}
""")
    assert isinstance(r.modifiers[0], GradualKSModifier)
    assert isinstance(r.modifiers[1], ConstantKSModifier)
    assert (r.modifiers[1].start_epoch, r.modifiers[1].end_epoch) == (-1, -1)
    assert isinstance(r.modifiers[2], QuantizationModifier)


def test_learning_rate_modifier_without_end_epoch_runs_to_the_end():
    r = load_recipe("""
- !EpochRangeModifier {start_epoch: 0, end_epoch: 4}
- !LearningRateModifier {start_epoch: 0, lr_class: ExponentialLR, lr_kwargs: {gamma: 0.5}, init_lr: 1.0}
""")
    m = r.modifiers[1]
    assert isinstance(m, LearningRateModifier) and m.end_epoch == -1
    s = r.bind(2)
    assert [s.lr(k) for k in (0, 1, 2, 7, 8, 100)] == [1.0, 1.0, 0.5, 0.125, 0.125, 0.125]


def test_eval_expressions_over_top_level_variables():
    r = load_recipe("""
num_epochs: 10
pruning_start_target: 0.1
pruning_end_target: eval(1 - 0.5)
base: 0.8
training_modifiers:
  - !EpochRangeModifier {start_epoch: 0.0, end_epoch: eval(num_epochs)}
pruning_modifiers:
  - !GMPruningModifier
    params: __ALL__
    init_sparsity: 0.0
    final_sparsity: eval(0.9 * base)
    start_epoch: eval(pruning_start_target * num_epochs)
    end_epoch: eval(pruning_end_target * num_epochs)
    update_frequency: eval(min(1, num_epochs / 20))
""")
    m = r.modifiers[1]
    assert (m.start_epoch, m.end_epoch, m.update_frequency) == (1.0, 5.0, 0.5)
    assert m.final_sparsity == pytest.approx(0.72)


@pytest.mark.parametrize("expr, reason", [
    ("eval(__import__('os'))", "Call"),
    ("eval(missing * 2)", "undefined variable 'missing'"),
    ("eval(1 +)", "invalid expression"),
    ("eval(num.real)", "Attribute"),
    ("eval(1 / 0)", "cannot be computed"),
])
def test_bad_eval_expressions_are_located_errors(expr, reason):
    with pytest.raises(RecipeError) as err:
        load_recipe(f"num: 1\nmodifiers:\n  - !EpochRangeModifier\n    start_epoch: 0\n    end_epoch: {expr}\n")
    text = str(err.value)
    assert reason in text and "<string>:5:16" in text and "field 'end_epoch'" in text


def test_scientific_floats_without_a_dot_are_floats():
    r = load_recipe("- !SetLearningRateModifier {start_epoch: 0, learning_rate: 8e-5}")
    assert r.modifiers[0].learning_rate == 8e-5


def test_integers_accepted_where_floats_expected():
    r = load_recipe("- !EpochRangeModifier {start_epoch: 0, end_epoch: 3}")
    assert isinstance(r.modifiers[0].end_epoch, float)


@pytest.mark.parametrize("value", ['"3"', "true", "[3]", "null", ".nan", ".inf"])
def test_non_numbers_rejected_for_numbers(value):
    with pytest.raises(RecipeError, match="end_epoch"):
        load_recipe(f"- !EpochRangeModifier {{start_epoch: 0, end_epoch: {value}}}")


def test_every_problem_reported_at_once_with_positions():
    text = """version: 1.0.0
modifiers:
  - !GradualKSModifier
    params: []
    init_sparsity: 0.9
    final_sparsity: 1.2
    start_epoch: 5
    end_epoch: 2
    update_frequency: 0
    bogus: 1
  - !Foo {a: 1}
  - !LearningRateModifier {start_epoch: 0, end_epoch: 10, lr_class: StepLR, lr_kwargs: {gamma: 0.1}}
"""
    with pytest.raises(RecipeError) as err:
        load_recipe(text)
    problems = err.value.problems
    fields = {(p.field, p.location.line) for p in problems}
    assert ("params", 4) in fields
    assert ("final_sparsity", 6) in fields
    assert ("end_epoch", 8) in fields
    assert ("update_frequency", 9) in fields
    assert ("bogus", 10) in fields
    assert ("lr_kwargs", 12) in fields
    unknown = [p for p in problems if "unknown modifier tag '!Foo'" in p.message]
    assert unknown and "!GradualKSModifier" in unknown[0].message and unknown[0].location.line == 11
    text = str(err.value)
    assert text.startswith(f"{len(problems)} problems in <string>")
    assert "<string>:6:21: !GradualKSModifier (modifiers[0]), field 'final_sparsity'" in text
    assert "got 1.2" in text and "[0, 1)" in text


def test_unsupported_sparseml_fields_are_named():
    with pytest.raises(RecipeError) as err:
        load_recipe("""
- !GMPruningModifier {params: __ALL__, init_sparsity: 0, final_sparsity: 0.5, start_epoch: 0, end_epoch: 2,
                      update_frequency: 1, phased: true, score_type: movement}
""")
    text = str(err.value)
    assert "phased" in text and "not supported by recal" in text and "score_type" in text
    with pytest.raises(RecipeError, match="global_sparsity ranks single weights across layers; mask_type"):
        load_recipe("- !GMPruningModifier {params: __ALL__, init_sparsity: 0, final_sparsity: 0.5, start_epoch: 0, "
                    "end_epoch: 2, update_frequency: 1, mask_type: [1, 4], global_sparsity: true}")


def test_informational_log_types_accepted():
    r = load_recipe("- !ConstantPruningModifier {params: __ALL__, log_types: __ALL__}")
    assert r.modifiers[0].log_types == "__ALL__"


def test_unsupported_sparseml_modifier_names_the_construct():
    with pytest.raises(RecipeError, match="MovementPruningModifier is a SparseML modifier that recal does not support"):
        load_recipe("- !MovementPruningModifier {params: __ALL__}")


@pytest.mark.parametrize("text, message", [
    ("version: 2.0.0\nmodifiers:\n  - !EpochRangeModifier {start_epoch: 0, end_epoch: 1}", "unsupported recipe version 2.0.0"),
    ("modifiers: 3", "must be a list of modifiers"),
    ("modifiers:\n  - {start_epoch: 0}", "is not a tagged modifier"),
    ("modifiers:\n  - !EpochRangeModifier 3", "must be a mapping of fields"),
    ("a: 1", "no modifiers"),
    ("42", "a recipe is a mapping or a list"),
    ("", "the recipe is empty"),
    ("modifiers: [!EpochRangeModifier {start_epoch: 0, end_epoch: 1, start_epoch: 0}]", "field given twice"),
    ("stage:\n  pruning_modifiers:\n    ConstantPruningModifier: {}", "a staged recipe"),
    ("pruning_modifiers:\n  ConstantPruningModifier: {targets: x}", "untagged modifiers"),
    ("modifiers: [\n", "YAML error"),
    ("a: !!python/object:os.system {}\nmodifiers: []", "YAML error"),
    ("!!python/object/apply:os.system ['echo hi']", "YAML error"),
    ("x: &a [*a]", "contains itself"),
    ("modifiers:\n  - !EpochRangeModifier &m {start_epoch: 0, end_epoch: [*m]}", "recursive"),
])
def test_structural_errors(text, message):
    with pytest.raises(RecipeError, match=message):
        load_recipe(text)


def test_python_tags_never_construct_objects(tmp_path):
    marker = tmp_path / "pwned"
    with pytest.raises(RecipeError):
        load_recipe(f"!!python/object/apply:os.system ['touch {marker}']")
    assert not marker.exists()


def test_pyyaml_global_loaders_untouched():
    load_recipe(SEED)
    with pytest.raises(yaml.constructor.ConstructorError):
        yaml.safe_load("!GradualKSModifier {a: 1}")
    assert yaml.safe_load("x: 8e-5") == {"x": "8e-5"}


def test_missing_file_and_wrong_type(tmp_path):
    with pytest.raises(RecipeError, match="recipe file not found"):
        load_recipe(tmp_path / "nope.yaml")
    with pytest.raises(TypeError):
        load_recipe(3)  # type: ignore[arg-type]


def test_binary_file_is_a_clear_error(tmp_path):
    p = tmp_path / "r.yaml"
    p.write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(RecipeError, match="not UTF-8"):
        load_recipe(p)


def test_recipe_is_immutable():
    r = load_recipe(SEED)
    with pytest.raises(Exception):
        r.modifiers[1].final_sparsity = 0.1  # type: ignore[misc]
    with pytest.raises(Exception):
        r.version = "2"  # type: ignore[misc]


def test_shipped_recipes_load():
    names = sorted(p.name for p in RECIPES.glob("*.yaml"))
    assert len(names) >= 5
    for name in names:
        assert isinstance(load_recipe(RECIPES / name), Recipe)


def test_two_whole_model_quantization_modifiers_rejected():
    with pytest.raises(RecipeError, match="second QuantizationModifier"):
        load_recipe("- !QuantizationModifier {start_epoch: 0}\n- !QuantizationModifier {start_epoch: 1}")


def test_a_sparsity_to_params_mapping_is_one_modifier_per_sparsity():
    recipe = load_recipe("""
targets: &targets
  0.9: [conv1, conv2]
  0.95: [fc]
modifiers:
  - !GMPruningModifier {params: [], init_sparsity: 0.1, final_sparsity: *targets, start_epoch: 0, end_epoch: 2,
                        update_frequency: 1}
""")
    assert [(m.final_sparsity, m.params) for m in recipe.modifiers] == [(0.9, ("conv1", "conv2")), (0.95, ("fc",))]
    assert recipe.describe(1) == "!GradualKSModifier (modifiers[0])"
    assert load_recipe(recipe.to_yaml()) == recipe


def test_a_quantization_only_recipe_trains_at_least_one_epoch():
    """A recipe whose only modifier starts at epoch 0 and never ends (docs/decoders.md's W4A16) had max_epochs 0, so
    ``for epoch in range(manager.max_epochs)`` trained nothing and QAT never ran. Without an EpochRangeModifier it
    gets one epoch; with one, the range is the user's and stays."""
    from recal_core import load_recipe

    assert load_recipe("- !QuantizationModifier {start_epoch: 0, scheme: W4A16}\n").max_epochs == 1
    assert load_recipe("- !ConstantPruningModifier {params: __ALL_PRUNABLE__, start_epoch: 0}\n").max_epochs == 1
    pruned_then_quantized = ("- !GMPruningModifier {params: [w], init_sparsity: 0.1, final_sparsity: 0.5, "
                             "start_epoch: 0, end_epoch: 3, update_frequency: 1}\n"
                             "- !QuantizationModifier {start_epoch: 3}\n")
    assert load_recipe(pruned_then_quantized).max_epochs == 4
    ranged = "- !EpochRangeModifier {start_epoch: 0, end_epoch: 2}\n- !QuantizationModifier {start_epoch: 0}\n"
    assert load_recipe(ranged).max_epochs == 2
    ending = "- !SetLearningRateModifier {start_epoch: 0, learning_rate: 0.1}\n- !QuantizationModifier {start_epoch: 2}\n"
    assert load_recipe(ending).max_epochs == 3


def test_bundled_recipes_load_by_name_from_any_folder(tmp_path, monkeypatch, capsys):
    """``recal:NAME`` loads a recipe shipped in the package wherever the process runs; ``recal recipes`` lists each
    with its header's first sentence; an unknown name lists those there are."""
    from recal_app.cli import main
    from recal_core import RecipeError, load_recipe
    from recal_core.bundled import bundled_recipes

    monkeypatch.chdir(tmp_path)
    assert load_recipe("recal:prune_quant").max_epochs == 14
    assert main(["recipes"]) == 0
    listed = capsys.readouterr().out
    assert all(f"recal:{name}" in listed for name in bundled_recipes()) and "recal:prune_quant" in listed
    with pytest.raises(RecipeError, match=r"no bundled recipe 'recal:nope'; there are: recal:dense, "):
        load_recipe("recal:nope")
    with pytest.raises(RecipeError, match="no bundled recipe"):
        load_recipe("recal:../../etc/passwd")
