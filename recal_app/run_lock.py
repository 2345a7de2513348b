"""One run per output folder: a lock held while a run writes there, and the run's identity for resumes.

Two runs writing one folder would leave a mix (one run's report, the other's model); a resume under
another seed, recipe or framework would continue someone else's schedule. Both are refused with one
line that says what to do.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Any, Iterator

from recal_core.atomic import made_by_recal

LOCK_NAME = ".recal.lock"
RUN_FILE = "run.json"


@contextlib.contextmanager
def locked(folder: Path) -> Iterator[None]:
    """Hold ``folder``'s lock (an advisory ``flock``, released when the process ends, even by kill -9)."""
    try:
        import fcntl
    except ImportError:  # not POSIX: no advisory locks; runs are not protected from each other
        yield
        return
    fd = os.open(folder / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise RuntimeError(f"another recal run is writing {folder}; wait for it to end, or give another "
                               "--output") from None
        yield
    finally:
        os.close(fd)


def run_identity(framework: str, seed: int, recipe_yaml: str, epochs: int) -> dict[str, Any]:
    return {"framework": framework, "seed": seed, "recipe": recipe_yaml, "epochs": epochs}


def read_resume_record(path: Path, required: tuple[str, ...]) -> dict[str, Any]:
    """A JSON record a resume reads (``run.json``, TF's ``history.json``), with ``required`` keys; one clear
    error when it is missing, unreadable or incomplete."""
    try:
        saved = json.loads(path.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"--resume: no checkpoint in {path.parent} (no {path.name})") from None
    except (OSError, ValueError) as exc:
        raise ValueError(f"--resume: {path} is unreadable ({exc})") from None
    missing = [k for k in required if not isinstance(saved, dict) or k not in saved]
    if missing:
        raise ValueError(f"--resume: {path} lacks {', '.join(missing)}")
    return saved


def check_resume(checkpoints: Path, identity: dict[str, Any]) -> None:
    """Refuse a resume whose framework, seed or recipe differs from the run that wrote ``checkpoints``."""
    saved = read_resume_record(checkpoints / RUN_FILE, ("framework", "seed", "recipe"))
    for key, label in (("framework", "--framework"), ("seed", "--seed"), ("recipe", "recipe")):
        if saved.get(key) != identity[key]:
            shown = "a different recipe" if key == "recipe" else f"{label} {saved.get(key)!r}"
            raise ValueError(f"--resume: the checkpoints in {checkpoints} were written with {shown}, this run "
                             f"has {'another' if key == 'recipe' else repr(identity[key])}; resume with the same "
                             f"{label}, or give another --output")


def check_fresh(checkpoints: Path) -> None:
    """A new run must not mix with an earlier run's checkpoints (a later --resume would pick them up), nor write over
    files recal did not write: its folder holds nothing but recal's lock and temporaries."""
    if checkpoints.is_dir() and any(checkpoints.iterdir()):
        raise RuntimeError(f"{checkpoints} holds an earlier run's checkpoints; continue it with --resume, or give "
                           "another --output")
    out = checkpoints.parent
    foreign = sorted(p.name for p in out.iterdir() if p.name != LOCK_NAME and not made_by_recal(p)
                     and p != checkpoints) if out.is_dir() else []
    if foreign:
        listed = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
        raise FileExistsError(f"{out} holds files recal did not write ({listed}); a new run writes model, report and "
                              "checkpoint files there and would replace them: give an empty or new --output")


def restore_checkpoint(restore, path: Path) -> None:
    """Run ``restore()`` (TensorFlow's), turning its errors on a torn or foreign checkpoint into one line that
    names the file and what to do, instead of TensorFlow's stack trace."""
    import tensorflow as tf

    try:
        restore()
    except (tf.errors.OpError, ValueError, AssertionError, IndexError, OSError) as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
        raise ValueError(f"--resume: checkpoint {path} cannot be restored ({first}): it is torn or was written by "
                         "another model; remove the run's checkpoints folder to start afresh") from None
