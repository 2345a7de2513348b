"""The README's and the manual's examples run as written (Python blocks, and the `recal` command lines)."""

import re
import sys
from pathlib import Path

import pytest

from tests.support.paths import ROOT
from tests.support.forked import run_program

# the examples found once, as check-wheel runs them from the installed wheel (docs/index.md is the README itself)
from docs_examples import pages, python_blocks, recal_lines, short

PAGES = pages()
PYTHON_BLOCKS = python_blocks()
BASH_BLOCKS = re.findall(r"```bash\n(.*?)```", PAGES["README"], re.DOTALL)
RECAL_LINES = recal_lines()


def test_readme_opens_with_the_two_commands():
    first = BASH_BLOCKS[0]
    assert "make demo" in first and "make test" in first


def _workdir(tmp_path):
    """A scratch folder, away from the checkout (recipes are named ``recal:NAME``, shipped in the package; an example
    makes whatever else it reads), that keeps what the examples write out of the repository."""
    return tmp_path


def test_the_examples_are_found():
    assert len(PYTHON_BLOCKS) == 15 and len(RECAL_LINES) == 4  # a page that loses a block fails here


@pytest.mark.parametrize("code", [code for _, code in PYTHON_BLOCKS], ids=[name for name, _ in PYTHON_BLOCKS])
def test_python_example_runs(code, tmp_path):
    """Each block as ``python -c`` runs it, in a process of its own (forked with the libraries imported:
    tests/support/forked.py)."""
    result = run_program(code=code, cwd=_workdir(tmp_path), env={"PYTHONPATH": str(ROOT)})
    assert result.returncode == 0, result.stderr[-3000:]


@pytest.mark.parametrize("line", RECAL_LINES)
def test_recal_command_runs(line, tmp_path):
    argv = short(line)  # a `recal train` cut to 2 epochs: the slow tests train in full
    exe = Path(sys.executable).parent / "recal"  # the installed entry point's script, run as a program
    result = run_program(str(exe), *argv[1:], cwd=_workdir(tmp_path))
    assert result.returncode == 0, result.stderr[-3000:]


YAML_BLOCKS = [(page, block) for page, text in PAGES.items()
               for block in re.findall(r"```yaml\n(.*?)```", text, re.DOTALL)]


@pytest.mark.parametrize("recipe", [b for _, b in YAML_BLOCKS], ids=[p for p, _ in YAML_BLOCKS])
def test_yaml_recipes_in_the_manual_validate(recipe):
    """A recipe shown in the manual (or a part of one: a list of modifiers under ``modifiers:``) is one recal
    reads."""
    from recal_core import load_recipe

    text = recipe if recipe.lstrip().startswith(("modifiers:", "version:")) else "modifiers:\n" + recipe
    assert load_recipe(text).modifiers
