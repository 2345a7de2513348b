"""Every SparseML recipe in the corpus loads, or fails naming the construct recal does not support."""

import re
import warnings

import pytest

from recal_core import RecipeError, load_recipe
from recal_core.errors import RecipeWarning

from tests.support.paths import CORPUS

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
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RecipeWarning)  # SparseML 1.x defaults taken, each with a warning
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
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RecipeWarning)
                load_recipe(path)
            loaded += 1
        except RecipeError as err:
            if STAGED in str(err):
                assert len(err.problems) == 1, str(err)  # one message for the whole file
                staged += 1
    print(f"corpus: {loaded}/{len(FILES)} recipes load, {staged} staged LLM recipes refused with one message")
    assert len(FILES) == 76
    assert loaded == LOADED and staged == 21  # the other 2: REFUSED, defects of the files themselves


# The corpus files recal refuses that are not staged LLM recipes, each for a defect of the file itself. SparseML
# 1.8.0 cannot load the first either (its loader, sparseml.optim.helpers, yaml.safe_loads the front matter: the same
# ComposerError). It runs the second, its sparsity falling from 25% to 3% in a file named for 85%: the seed defines
# gradual pruning as sparsity rising to final_sparsity, and recal names the typo rather than un-pruning a model.
REFUSED = {
    "integrations_old-examples_pytorch_recipes_mobilenet-pruned_quant.md":  # *pruning_recovery_end_lr
        r":62:15: YAML error: found undefined alias 'pruning_recovery_end_lr'",
    "integrations_old-examples_rwightman-timm_recipes_vit_base.85.recal.config.yaml":  # pruning that un-prunes
        r":6:25: .*final_sparsity \(0.03\) must be >= init_sparsity \(0.25\)",
}
LOADED = 53  # recipes that load as they are (tests/core/test_roundtrip.py round-trips each)
WITHOUT_START = "src_sparseml_experimental_sparsegpt_examples_opt_recipes_opt-1.3b-opt_pretrain-pruned50_quantW8A8.md"


@pytest.mark.skipif(not FILES, reason=f"compatibility corpus not found at {CORPUS}")
def test_a_quantization_modifier_without_start_epoch_runs_from_the_start_with_a_warning():
    """The seed requires start_epoch; SparseML 1.x ran a QuantizationModifier without one from the first step."""
    with pytest.warns(RecipeWarning, match=r":4:5: !QuantizationModifier .*no start_epoch: QAT runs from the first "
                                           r"step") as caught:
        recipe = load_recipe(CORPUS / WITHOUT_START)
    assert len(caught) == 1 and recipe.modifiers[0].start_epoch == -1


@pytest.mark.skipif(not FILES, reason=f"compatibility corpus not found at {CORPUS}")
@pytest.mark.parametrize("name, message", REFUSED.items(), ids=list(REFUSED))
def test_defective_corpus_files_are_refused_at_the_defect(name, message):
    with pytest.raises(RecipeError) as err:
        load_recipe(CORPUS / name)
    assert len(err.value.problems) == 1 and re.search(message, str(err.value)), str(err.value)
