"""The test suite's models, for the benchmarks that measure what the suite checks (the zoo's CNNs and their recipe,
the causal LM wrapper): ``suite_module("tests.e2e.zoo.test_cnns")``. The suite is not installed, so its checkout's
root is appended to ``sys.path`` here, the one place a benchmark reaches past the installed packages."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]


def suite_module(name: str) -> ModuleType:
    """The test suite's module ``name`` (``tests....``), imported from this checkout."""
    if str(ROOT) not in sys.path:
        sys.path.append(str(ROOT))  # after the installed packages: recal still comes from the install
    return importlib.import_module(name)
