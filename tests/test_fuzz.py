"""No input makes the loader raise anything but RecipeError (hypothesis, >= 2,000 cases)."""

import random

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from recal_core import RecipeError, load_recipe

from .conftest import RECIPES

VALID_TEXTS = [p.read_text() for p in sorted(RECIPES.glob("*.yaml"))]
YAML_TOKENS = ["- ", ": ", "!GradualKSModifier", "!Foo", "!!python/object:os.system", "&a ", "*a", "{", "}",
               "[", "]", "eval(", ")", "---", "\n", "  ", "__ALL__", "re:(", "-1", "1e9", ".nan", "null",
               "'", '"', "#", "|", ">", "?", "%YAML 1.1\n", "<<: *a", "\t", "\x00", "modifiers", "version"]


def _assert_only_recipe_errors(text: str) -> None:
    try:
        load_recipe(text)
    except RecipeError as err:
        assert "internal error" not in str(err), str(err)
        assert err.problems


@settings(max_examples=800, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.text(max_size=300))
def test_arbitrary_text(text):
    _assert_only_recipe_errors(text)


@settings(max_examples=800, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.sampled_from(YAML_TOKENS + ["a", "0", "0.5", "x"]), max_size=40))
def test_yaml_shaped_garbage(tokens):
    _assert_only_recipe_errors("".join(tokens))


@settings(max_examples=800, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, len(VALID_TEXTS) - 1), st.integers(0, 2**32 - 1), st.integers(1, 6))
def test_mutated_valid_recipes(which, seed, edits):
    rng = random.Random(seed)
    text = list(VALID_TEXTS[which])
    for _ in range(edits):
        op = rng.randrange(4)
        pos = rng.randrange(len(text) + 1)
        if op == 0 and text:  # delete a span
            del text[pos: pos + rng.randrange(1, 12)]
        elif op == 1:  # insert a token
            text[pos:pos] = list(rng.choice(YAML_TOKENS))
        elif op == 2 and text:  # swap a character
            text[min(pos, len(text) - 1)] = rng.choice("0123456789.-:!&*[]{}\n x")
        else:  # duplicate a line
            lines = "".join(text).splitlines(keepends=True)
            if lines:
                i = rng.randrange(len(lines))
                lines.insert(i, lines[i])
                text = list("".join(lines))
    _assert_only_recipe_errors("".join(text))
