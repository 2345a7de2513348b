"""TensorFlow's start-up lines, kept out of a user's output where its own log level cannot reach them.

TensorFlow 2.20+ logs through absl before absl is initialised, so ``TF_CPP_MIN_LOG_LEVEL`` does not silence
``oneDNN custom operations are on`` (nor the line announcing that logging is uninitialised), printed from C++ on
every import. While TensorFlow (or Keras on it) is first imported, the process's stderr goes to a temporary file;
then every line but those informational ones is written back, so a warning or error from the import still shows.
"""

from __future__ import annotations

import importlib
import os
import re
import sys
import tempfile
from types import ModuleType

_START_UP = re.compile(
    r"WARNING: All log messages before absl::InitializeLog\(\) is called are written to STDERR"
    r"|I\d{4} [\d:. ]+\d+ (?:port|cpu_feature_guard)\.cc:\d+\] .*"
    r"|To enable the following instructions: .*, in other operations, rebuild TensorFlow with the appropriate "
    r"compiler flags\.")


def import_quietly(name: str) -> ModuleType:
    """``import name`` (``tensorflow`` or ``keras``) with TensorFlow's start-up lines dropped from stderr; a module
    already imported is returned as it is."""
    if name in sys.modules or "tensorflow" in sys.modules:
        return importlib.import_module(name)
    try:
        saved = os.dup(2)
    except OSError:  # no file descriptor 2 (a GUI process): nothing to keep clean
        return importlib.import_module(name)
    with tempfile.TemporaryFile() as captured:
        sys.stderr.flush()
        os.dup2(captured.fileno(), 2)
        try:
            return importlib.import_module(name)
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            captured.seek(0)
            lines = captured.read().decode(errors="replace").splitlines(keepends=True)
            sys.stderr.write("".join(line for line in lines if not _START_UP.fullmatch(line.rstrip("\n"))))
