"""Where a benchmark's figures go: its JSON, labelled with the machine that measured it, read back by
``scripts/render_docs.py`` for the docs' tables (``docs/results/``).

A figure is only comparable with figures from the same CPU: :func:`machine` records the CPU's name and the flags
that decide integer speed (AVX2, AVX-512, VNNI, AMX), and :func:`save_run` keeps one run per CPU in a file, so a
run on an AVX2 machine sits beside the VNNI one instead of replacing it.
"""

from __future__ import annotations

import json
import platform
import sys
from pathlib import Path

from recal_core import atomic_path

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "docs" / "results"


def machine() -> dict:
    """The CPU (name and integer-speed flags) and the versions of what ran: a run's label."""
    import onnxruntime as ort

    from recal_onnx import cpu

    label = {"cpu": cpu.describe(), "onnxruntime": ort.__version__, "python": platform.python_version()}
    for name in ("torch", "tensorflow", "keras", "jax"):
        if name in sys.modules:
            label[name] = getattr(sys.modules[name], "__version__", "?")
    return label


def sessions_clause(run: dict) -> str:
    """How many sessions each file was timed in, as a caption says it ('' for one)."""
    return f" of {run['sessions']} sessions each" if run.get("sessions", 1) > 1 else ""


def save(path: Path, data: dict) -> None:
    """``data`` as indented JSON at ``path``, written whole or not at all."""
    with atomic_path(path) as tmp:
        Path(tmp).write_text(json.dumps(data, indent=1, default=str) + "\n")
    print(f"wrote {path}")


def report(data: dict, text: str, path: Path | None) -> int:
    """A benchmark's end: its table printed, its data saved at ``path`` when given; the exit status."""
    print(text)
    if path:
        save(path, data)
    return 0


def save_run(path: Path, run: dict) -> None:
    """``run`` (its ``cpu`` from :func:`machine`) into ``path``'s ``runs``, replacing only the run measured on the
    same CPU."""
    runs = json.loads(Path(path).read_text())["runs"] if Path(path).exists() else []
    save(path, {"runs": [*(r for r in runs if r["cpu"] != run["cpu"]), run]})


def load(name: str | Path) -> dict:
    """A saved result: a file name under ``docs/results/``, or a path."""
    path = Path(name)
    return json.loads((RESULTS / path if len(path.parts) == 1 else path).read_text())
