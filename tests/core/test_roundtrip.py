"""A recipe written with to_yaml loads back equal: every modifier, every shipped and corpus recipe."""

import warnings

import pytest

from recal_core import RecipeError, load_recipe
from recal_core.errors import RecipeWarning

from tests.support.paths import CORPUS, RECIPES
from tests.core.test_modifier_validation import VALID, _recipe


@pytest.mark.parametrize("tag", sorted(VALID))
def test_every_modifier_round_trips(tag):
    r = load_recipe(_recipe(tag, VALID[tag]))
    text = r.to_yaml()
    assert f"!{tag}" in text
    assert load_recipe(text) == r


def test_round_trip_keeps_non_default_values():
    r = load_recipe("""
- !GMPruningModifier {params: [a.weight, "re:b.*"], init_sparsity: 0.1, final_sparsity: 0.9, start_epoch: 0.5,
                      end_epoch: 2.5, update_frequency: -1, inter_func: inverse_cubic, leave_enabled: false,
                      log_types: [tensorboard]}
""")
    again = load_recipe(r.to_yaml())
    assert again == r
    assert again.modifiers[0].params == ("a.weight", "re:b.*")
    assert "!GradualKSModifier" in r.to_yaml()  # canonical tag


def test_changed_recipe_is_not_equal():
    a = load_recipe("- !EpochRangeModifier {start_epoch: 0, end_epoch: 3}")
    b = load_recipe("- !EpochRangeModifier {start_epoch: 0, end_epoch: 4}")
    assert a != b


@pytest.mark.parametrize("path", sorted(RECIPES.glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_recipes_round_trip(path):
    r = load_recipe(path)
    assert load_recipe(r.to_yaml()) == r


def test_loadable_corpus_recipes_round_trip():
    if not CORPUS.is_dir():
        pytest.skip(f"compatibility corpus not found at {CORPUS}")
    from tests.core.test_compat_corpus import LOADED

    count = 0
    for path in sorted(CORPUS.iterdir()):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RecipeWarning)
                r = load_recipe(path)
        except RecipeError:
            continue
        assert load_recipe(r.to_yaml()) == r, path.name
        count += 1
    assert count == LOADED  # every recipe that loads round-trips
