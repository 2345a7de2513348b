"""The examples in docstrings run (the style guide: every public function's example runs)."""

import doctest
import importlib

import pytest

MODULES = ["recal_core.recipe", "recal_core.schedule", "recal_core.schedules", "recal_core.expressions",
           "recal_core.atomic", "recal_torch.manager", "recal_torch.export.to_onnx", "recal_torch", "recal_onnx.targets"]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.failed == 0
    assert result.attempted > 0 or name == "recal_torch"
