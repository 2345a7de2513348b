"""``recal train``: train the bundled digits classifier under a recipe and report every artefact.

This module owns the run (locks, checkpoints' identity, the report and the plot); each framework's work is done by
its trainer in this package, imported only when that framework is asked for (an install with one framework runs):

- :data:`TRAINERS`: ``torch`` / ``tf`` / ``keras`` -> the module whose ``train`` is a :class:`Trainer` (trains,
  checkpoints, exports);
- :mod:`recal_app.onnx_artefacts`: ``evaluate`` (accuracy, sparsity, latency in onnxruntime) and ``quantize``
  (``quantize_qat_export``), applied to the ONNX artefacts a trainer returns.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import math
import logging
import os
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Protocol

import numpy as np

from recal_core.atomic import TEMP_PREFIX, remove_stale_temporaries, write_text_atomically
from recal_core.recipe import Recipe
from .errors import DivergedError
from .measures import median_latency_ms, overall_sparsity  # noqa: F401 - re-exported for the trainers
from .report import plot_schedule
from .run_lock import LOCK_NAME, RUN_FILE, check_fresh, check_resume, locked, run_identity

log = logging.getLogger(__name__)

# Both trainers use these, so PyTorch and TensorFlow runs of one recipe see the same data, in the
# same order, with the same steps per epoch and base LR.
BATCH_SIZE = 32
LEARNING_RATE = 0.05


def epoch_order(size: int, seed: int, epoch: int) -> np.ndarray:
    """The order of the ``size`` training examples in ``epoch`` (a function of seed and epoch, so a
    resumed run sees exactly the batches an uninterrupted one would)."""
    return np.random.default_rng(seed * 100_003 + epoch).permutation(size)


def progress_bar(iterable, desc: str, enabled: bool):
    """A live tqdm bar on a terminal; nothing in a log or a pipe (trainers print one line per epoch there)."""
    import sys

    from tqdm import tqdm

    live = enabled and sys.stderr.isatty()
    return tqdm(iterable, desc=desc, disable=not live, leave=False, dynamic_ncols=True, mininterval=0.5)


def epoch_line(framework: str, record: "EpochRecord", epochs: int) -> str:
    """The one line per epoch both trainers print."""
    lr = "-" if record.lr is None else f"{record.lr:.4g}"
    return (f"{framework} epoch {record.epoch}/{epochs}: loss {record.loss:.4f}, test accuracy "
            f"{record.test_accuracy:.4f}, sparsity {record.sparsity:.3f}, lr {lr}")


@dataclass
class EpochRecord:
    epoch: int  # epochs completed
    loss: float
    train_accuracy: float
    test_accuracy: float
    sparsity: float  # over the prunable weights
    lr: float | None


@dataclass
class Artefact:
    name: str
    framework: str
    path: str
    accuracy: float | None = None
    sparsity: float | None = None
    layer_sparsity: dict[str, float] = field(default_factory=dict)
    size_bytes: int = 0
    latency_ms: float | None = None  # median, batch 1
    runtime: str = ""  # what measured accuracy and latency
    qat: bool = False  # an ONNX export of a QAT model (to be quantized)
    macs: int | None = None  # multiply-adds per sample of its conv/linear layers
    params: int | None = None


@dataclass
class TrainingRun:
    framework: str
    recipe_source: str
    out_dir: str
    epochs: int
    seed: int
    steps_per_epoch: int
    history: list[EpochRecord] = field(default_factory=list)
    artefacts: list[Artefact] = field(default_factory=list)


class Trainer(Protocol):
    def __call__(self, recipe: Recipe, out_dir: Path, *, epochs: int, seed: int, resume: bool,
                 progress: bool) -> TrainingRun: ...


TRAINERS = {"torch": "recal_app.torch_trainer", "tf": "recal_app.tf_trainer", "keras": "recal_app.keras_trainer"}


def _trainer(framework: str) -> Trainer:
    """The ``train`` function of ``framework``'s trainer module (imported now: it imports the framework)."""
    if framework not in TRAINERS:
        raise ValueError(f"unknown framework {framework!r}; use one of {', '.join(TRAINERS)}")
    return importlib.import_module(TRAINERS[framework]).train


def check_finite(framework: str, step: int, loss: float | None = None, weights=()) -> None:
    """Stop a run whose loss or weights stopped being finite, with one line naming the step (before anything of
    that step is saved: the last complete checkpoint stays the one to resume from, and nothing is exported).

    Args:
        framework: the trainer's name, for the message.
        step: the global step (1-based) just taken.
        loss: that step's loss, when known.
        weights: arrays (anything ``numpy.isfinite`` takes) to check too.
    """
    bad = None
    if loss is not None and not math.isfinite(loss):
        bad = f"the loss is {loss}"
    else:
        bad = next((f"a weight is {value}" for w in weights
                    for value in [_first_non_finite(w)] if value is not None), None)
    if bad is not None:
        raise DivergedError(f"{framework} training diverged at step {step}: {bad} (a learning rate too high for this "
                       "model?); stopped: the last complete checkpoint is kept and no model was exported")


def _first_non_finite(array) -> float | None:
    values = np.asarray(array)
    finite = np.isfinite(values)
    return None if finite.all() else float(values[~finite].flat[0])


def check_writable(out_dir: Path) -> None:
    """Create ``out_dir`` if needed and prove it is writable, before any training starts."""
    if out_dir.is_symlink() and not out_dir.exists():
        raise OSError(f"output folder {out_dir} is a symbolic link to {os.readlink(out_dir)}, which does not exist: "
                      "create that folder, or choose another --output")
    if out_dir.exists() and not out_dir.is_dir():
        raise OSError(f"output folder {out_dir} is a file, not a folder: choose another --output")
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=out_dir, prefix=TEMP_PREFIX + "write-test-", suffix=".tmp"):
            pass
    except OSError as exc:
        raise OSError(f"output folder {out_dir} is not writable: {exc.strerror or exc}") from None


def train(recipe: Recipe, framework: str, out_dir: str | os.PathLike, *, epochs: int | None = None, seed: int = 0,
          resume: bool = False, progress: bool = True, quantize: bool = True) -> TrainingRun:
    """Train under ``recipe``; write checkpoints, TensorBoard events, artefacts, report and plot to ``out_dir``.

    Everything that can be checked is checked before the folder is touched. While the run writes,
    ``out_dir`` is locked (a second run there fails at once); a fresh run refuses a folder that holds
    another run's checkpoints, and a resume refuses checkpoints of another framework, seed or recipe.

    Args:
        recipe: the recipe.
        framework: ``"torch"``, ``"tf"`` or ``"keras"``.
        out_dir: the run's folder.
        epochs: epochs to train (the recipe's when None).
        seed: the run's seed.
        resume: continue from the folder's last checkpoint.
        progress: show a progress bar.
        quantize: convert a QAT run's export to int8.
    """
    out = Path(out_dir)
    trainer = _trainer(framework)
    total = epochs if epochs is not None else recipe.max_epochs
    if total < 1:
        raise ValueError(f"nothing to train: {total} epochs (give --epochs, or an EpochRangeModifier)")
    if total < recipe.max_epochs:
        log.warning("training %d epochs, but the recipe's schedule runs to epoch %d", total, recipe.max_epochs)
    checkpoints = out / "checkpoints"
    made = [p for p in (out, out / LOCK_NAME, checkpoints) if not p.exists()]  # what a failed start removes
    check_writable(out)
    try:
        with locked(out):
            for folder in (out, checkpoints):
                if folder.is_dir():
                    remove_stale_temporaries(folder)
            identity = run_identity(framework, seed, recipe.to_yaml(), total)
            if resume:
                check_resume(checkpoints, identity)
            else:
                check_fresh(checkpoints)
                checkpoints.mkdir(parents=True, exist_ok=True)
                write_text_atomically(checkpoints / RUN_FILE, json.dumps(identity, indent=2) + "\n")
                made.append(checkpoints / RUN_FILE)
            return _train_locked(recipe, trainer, out, total, seed, resume, progress, quantize)
    except BaseException:
        _undo_start(made, checkpoints)
        raise


def _undo_start(made: list[Path], checkpoints: Path) -> None:
    """After a failure before the first checkpoint: remove what this run's start created (its run
    description, the checkpoints folder, the lock file, the output folder), so bad input leaves nothing."""
    if checkpoints.is_dir() and any(p.name != RUN_FILE for p in checkpoints.iterdir()):
        return  # an epoch completed: its checkpoint (and what resumes it) stays
    for path in reversed(made):
        with contextlib.suppress(OSError):
            path.rmdir() if path.is_dir() else path.unlink()


def _train_locked(recipe: Recipe, trainer: Trainer, out: Path, total: int, seed: int, resume: bool,
                  progress: bool, quantize: bool) -> TrainingRun:
    run = trainer(recipe, out, epochs=total, seed=seed, resume=resume, progress=progress)
    onnx_artefacts = [a for a in run.artefacts if a.path.endswith(".onnx")]
    if onnx_artefacts:
        from .onnx_artefacts import evaluate, quantize  # onnxruntime: only for runs that write ONNX
        for artefact in onnx_artefacts:
            evaluate(artefact)
        qat = next((a for a in onnx_artefacts if a.qat), None)
        if qat is not None and quantize:
            int8 = Artefact("int8 ONNX (quantize_qat_export)", run.framework, str(out / "model.int8.onnx"),
                            macs=qat.macs, params=qat.params)
            quantize(qat.path, int8.path)
            evaluate(int8)
            run.artefacts.append(int8)
    write_report(run, recipe)
    schedule = recipe.bind(run.steps_per_epoch)
    measured = {"epoch": [h.epoch for h in run.history], "sparsity": [h.sparsity for h in run.history],
                "accuracy": [h.test_accuracy for h in run.history]}
    plot_schedule(schedule, out / "schedule.png", measured=measured)
    return run


def write_report(run: TrainingRun, recipe: Recipe) -> None:
    out = Path(run.out_dir)
    write_text_atomically(out / "report.json", json.dumps(asdict(run), indent=2) + "\n")
    lines = [f"# recal training report ({run.framework})", "",
             f"- recipe: `{run.recipe_source}` ({len(recipe.modifiers)} modifiers)",
             f"- epochs: {run.epochs}, steps per epoch: {run.steps_per_epoch}, seed: {run.seed}",
             f"- final test accuracy (training framework): {run.history[-1].test_accuracy:.4f}" if run.history else "",
             "", ARTEFACT_HEADER, "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    lines += [artefact_row(a) for a in run.artefacts]
    lines += ["", "## Per-layer sparsity", ""]
    for a in run.artefacts:
        if a.layer_sparsity:
            lines.append(f"**{a.name}**: " + ", ".join(f"`{k}` {v:.3f}" for k, v in a.layer_sparsity.items()))
            lines.append("")
    lines += ["## Per epoch", "", "| epoch | loss | train acc | test acc | sparsity | lr |",
              "| --- | --- | --- | --- | --- | --- |"]
    lines += [f"| {h.epoch} | {h.loss:.4f} | {h.train_accuracy:.4f} | {h.test_accuracy:.4f} | {h.sparsity:.4f} | "
              f"{'-' if h.lr is None else f'{h.lr:.4g}'} |" for h in run.history]
    write_text_atomically(out / "report.md", "\n".join(lines) + "\n")


def _fmt(value: float | None, pattern: str, missing: str = "-") -> str:
    return missing if value is None else pattern.format(value)


ARTEFACT_HEADER = "| artefact | accuracy | sparsity | size | MACs / params | latency (batch 1) | measured in | path |"


def artefact_row(a: Artefact) -> str:
    work = "-" if a.macs is None else f"{a.macs / 1e6:.3g} M / {a.params / 1e3:.3g} k"
    return (f"| {a.name} | {_fmt(a.accuracy, '{:.4f}')} | {_fmt(a.sparsity, '{:.3f}', 'unknown')} | "
            f"{a.size_bytes / 1024:.1f} KiB | {work} | {_fmt(a.latency_ms, '{:.3f} ms')} | {a.runtime} | `{a.path}` |")
