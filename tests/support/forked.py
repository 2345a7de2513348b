"""A program (a script, or a ``python -c`` example) run as its own process, forked from a server that has already
imported torch, TensorFlow, onnxruntime and recal.

A new interpreter spends 3-8 s importing those before an example's first line; the suite runs some twenty
examples and scripts as programs. Forked from the server (:mod:`multiprocessing`'s ``forkserver``, with those
modules preloaded), each still runs in a process of its own: ``__main__``, its own ``sys.argv``, working folder,
environment, globals and exit status, and its output captured at the file descriptors (a library's C++ logs
included). What an import reads from the environment (``KERAS_BACKEND``, ``TF_CPP_MIN_LOG_LEVEL``) is the
server's: a test about start-up or import-time settings uses :mod:`subprocess`.
"""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
import tempfile
from pathlib import Path

_PRELOAD = "tests.support.forked_preload"
_context = None


def _server():
    global _context
    if _context is None:
        _context = multiprocessing.get_context("forkserver")
        _context.set_forkserver_preload([_PRELOAD])
    return _context


def run_program(*argv: str, code: str | None = None, cwd: str | Path | None = None, env: dict | None = None,
                timeout: float = 600) -> subprocess.CompletedProcess:
    """``python SCRIPT ARGS``, ``python -m MODULE ARGS`` (``argv`` starting with ``-m``) or ``python -c CODE ARGS``, as
    :func:`subprocess.run` with ``capture_output=True, text=True`` reports it.

    Args:
        argv: the script's path (or ``-m`` and a module) and its arguments (with ``code``: the arguments only).
        code: the program's source, run as ``python -c`` runs it.
        cwd: the working folder (default: this process's).
        env: variables set in the program's environment, over this process's.
        timeout: seconds before the program is killed and :class:`subprocess.TimeoutExpired` raised.
    """
    with tempfile.TemporaryDirectory() as tmp:
        out, err = Path(tmp) / "stdout", Path(tmp) / "stderr"
        process = _server().Process(target=_main, args=(list(argv), code, str(cwd or os.getcwd()), dict(env or {}),
                                                         str(out), str(err)))
        process.start()
        process.join(timeout)
        if process.exitcode is None:
            process.kill()
            process.join()
            raise subprocess.TimeoutExpired(argv or ["-c"], timeout)
        shown = ["python", *(["-c", code] if code is not None else []), *argv]
        return subprocess.CompletedProcess(shown, process.exitcode, out.read_text(errors="replace"),
                                           err.read_text(errors="replace"))


def _main(argv: list[str], code: str | None, cwd: str, env: dict, out: str, err: str) -> None:
    """In the forked process: stdout and stderr onto the files (file descriptors 1 and 2, so that C++ logs land
    there too), then the program as the interpreter would run it."""
    import runpy

    for fd, path in ((1, out), (2, err)):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(target, fd)
        os.close(target)
    sys.stdout = open(1, "w", buffering=1, closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False)
    os.environ.update(env)
    os.chdir(cwd)
    if code is not None:
        sys.argv = ["-c", *argv]
        sys.path.insert(0, "")
        exec(compile(code, "<string>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
    elif argv[0] == "-m":
        sys.argv = [argv[1], *argv[2:]]
        sys.path.insert(0, cwd)
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = list(argv)
        sys.path.insert(0, str(Path(argv[0]).resolve().parent))
        runpy.run_path(argv[0], run_name="__main__")
