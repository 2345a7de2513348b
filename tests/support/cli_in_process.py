"""``recal ARGS`` run inside the test process: the command's own ``main``, exit status, stdout and stderr, with the
logging set-up ``main`` makes (its handler writes to the captured stderr, as it would to a terminal's).

A new interpreter costs 4-6 s of imports (torch; TensorFlow with Keras) before the command does anything, and most
CLI tests check one refusal's line. What only a separate process shows (the installed entry point, signals and
kills, another process's file lock, third-party output at start-up) is still tested with ``subprocess``."""

from __future__ import annotations

import contextlib
import io
import logging
import subprocess

_LOGGERS = ("recal", "recal_core", "recal_torch", "recal_tf", "recal_onnx")


def run_recal(*args: str) -> subprocess.CompletedProcess:
    """``recal *args`` in this process, as :func:`subprocess.run` with ``capture_output=True, text=True`` reports
    it (the usage errors argparse exits with included)."""
    from recal_app.cli import main

    out, err = io.StringIO(), io.StringIO()
    root = logging.getLogger()
    saved_root = root.handlers[:], root.level
    saved_levels = {name: logging.getLogger(name).level for name in _LOGGERS}
    root.handlers = []  # so main's logging.basicConfig installs its handler, on the captured stderr
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(list(args))
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    finally:
        for handler in root.handlers:
            handler.close()
        root.handlers, root.level = saved_root
        for name, level in saved_levels.items():
            logging.getLogger(name).setLevel(level)
    return subprocess.CompletedProcess(["recal", *args], code, out.getvalue(), err.getvalue())
