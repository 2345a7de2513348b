"""Every SparseML recipe in the corpus loads, or fails naming the construct recal does not support."""

import re

import pytest

from recal_core import RecipeError, load_recipe

from .conftest import CORPUS

FILES = sorted(CORPUS.iterdir()) if CORPUS.is_dir() else []

# What an unsupported construct's message must name (one of these per problem).
CONSTRUCTS = re.compile(
    r"SparseML modifier that recal does not support|not supported|unknown field|"
    r"a staged recipe|untagged modifiers|undefined alias|must be >=|required field|is empty")
STAGED = "SparseML's one-shot LLM format"


@pytest.mark.skipif(not FILES, reason=f"compatibility corpus not found at {CORPUS}")
@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_corpus_file_loads_or_names_what_is_unsupported(path):
    try:
        recipe = load_recipe(path)
    except RecipeError as err:
        for problem in err.problems:
            assert problem.location.source == str(path)
            assert problem.location.line is not None, str(problem)
            assert CONSTRUCTS.search(str(problem)), str(problem)
            if "modifier" in problem.message.lower() and problem.modifier is None:
                assert problem.field is None
        return
    assert recipe.modifiers
    assert recipe.max_epochs >= 0


@pytest.mark.skipif(not FILES, reason=f"compatibility corpus not found at {CORPUS}")
def test_corpus_load_count():
    loaded, staged = 0, 0
    for path in FILES:
        try:
            load_recipe(path)
            loaded += 1
        except RecipeError as err:
            if STAGED in str(err):
                assert len(err.problems) == 1, str(err)  # one message for the whole file
                staged += 1
    print(f"corpus: {loaded}/{len(FILES)} recipes load, {staged} staged LLM recipes refused with one message")
    assert len(FILES) == 76
    assert loaded >= 49 and staged == 21
