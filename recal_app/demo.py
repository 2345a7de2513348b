"""``recal demo``: the main job from an installed package, in a few minutes on 2 cores.

The bundled digits (scikit-learn's 1,797 handwritten digits, shipped inside scikit-learn: nothing is downloaded)
are trained three times: a dense baseline in PyTorch (``recal:dense``), then one recipe, ``recal:prune_quant``
(every kernel pruned to 85%, then QAT with 7-bit weights), in PyTorch and in the TensorFlow graph API; each QAT
model is exported to ONNX and converted to int8 by ``quantize_qat_export``, verified. A framework that is not
installed is left out, with the extra that brings it. The checkout's ``make demo`` adds a speed part.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from recal_core.atomic import write_text_atomically
from recal_core.recipe import load_recipe

FRAMEWORKS = {"torch": ("torch", "recal[torch]"), "tf": ("tensorflow", "recal[tf-cpu]")}


@dataclass(frozen=True)
class Job:
    framework: str
    label: str
    recipe: str
    folder: str


JOBS = (Job("torch", "dense baseline", "recal:dense", "torch-dense"),
        Job("torch", "prune 85% + QAT", "recal:prune_quant", "torch-prune-quant"),
        Job("tf", "prune 85% + QAT (same recipe)", "recal:prune_quant", "tf-prune-quant"))


def run_jobs(output: str | Path, seed: int = 0, progress: bool = True,
             frameworks: tuple[str, ...] = ("torch", "tf")) -> list[dict]:
    """Train :data:`JOBS` of ``frameworks`` into ``output``; one row per artefact (accuracy on the digits test set,
    sparsity, size, latency). A framework not installed is skipped with a line that names its extra.

    Args:
        output: the folder every run writes into.
        seed: the runs' seed.
        progress: show progress bars.
        frameworks: which of the demo's frameworks to run.
    """
    from .training import train

    out = Path(output)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for job in JOBS:
        if job.framework not in frameworks:
            continue
        module, extra = FRAMEWORKS[job.framework]
        if importlib.util.find_spec(module) is None:
            print(f"\n== {job.framework}: {job.label}: skipped, {module} is not installed (pip install {extra})")
            continue
        folder = out / job.folder
        print(f"\n== {job.framework}: {job.label} ({job.recipe}) -> {folder}", flush=True)
        _replace_earlier_demo_run(folder)
        run = train(load_recipe(job.recipe), job.framework, folder, seed=seed, progress=progress)
        rows += [{"framework": job.framework, "run": job.label, "artefact": a.name, "accuracy": a.accuracy,
                  "sparsity": a.sparsity, "size_bytes": a.size_bytes, "latency_ms": a.latency_ms, "path": str(a.path)}
                 for a in run.artefacts]
    return rows


def print_jobs(rows: list[dict]) -> None:
    """Print the demo's accuracy table.

    Args:
        rows: what :func:`run_jobs` returned.
    """
    print("\n1. accuracy on real data: the digits test set (360 images)\n")
    header = (f"{'framework':9s} {'run':32s} {'artefact':38s} {'accuracy':>8s} {'sparsity':>8s} {'size':>10s} "
              f"{'latency':>10s}")
    print(header)
    print("-" * len(header))
    for r in rows:
        sparsity = "unknown" if r["sparsity"] is None else f"{r['sparsity']:.3f}"
        print(f"{r['framework']:9s} {r['run']:32s} {r['artefact']:38s} {r['accuracy']:8.4f} {sparsity:>8s} "
              f"{r['size_bytes'] / 1e3:8.1f}kB {r['latency_ms']:8.3f}ms")
    print("\nsizes in kB (10^3 bytes); latency: median batch-1 inference in the artefact's runtime (PyTorch, "
          "TensorFlow or onnxruntime), on this CPU; accuracy for this seed")


def demo(output: str | Path = "demo_out", seed: int = 0, progress: bool = True,
         frameworks: tuple[str, ...] = ("torch", "tf")) -> Path:
    """Run, print the table and the outputs, and write every figure to ``<output>/demo.json``; return its path.

    Args:
        output: the folder every run writes into.
        seed: the runs' seed.
        progress: show progress bars.
        frameworks: which of the demo's frameworks to run.
    """
    started = time.perf_counter()
    rows = run_jobs(output, seed, progress, frameworks)
    if not rows:
        raise RuntimeError("recal demo trains with PyTorch or TensorFlow, and neither is installed: "
                           "pip install recal[torch] (or recal[tf-cpu])")
    print(f"\nrecal demo, {time.perf_counter() - started:.0f}s in all")
    print_jobs(rows)
    path = Path(output) / "demo.json"
    write_text_atomically(path, json.dumps({"seconds": round(time.perf_counter() - started), "seed": seed,
                                            "jobs": rows}, indent=1) + "\n")
    print("\noutputs:")
    for job in JOBS:
        if (Path(output) / job.folder / "report.md").is_file():
            print(f"  {Path(output) / job.folder}/report.md, schedule.png, tensorboard/")
    print(f"  {path}: every figure above")
    return path


def _replace_earlier_demo_run(folder: Path) -> None:
    """A second demo starts its jobs afresh: a folder holding an earlier demo job's run (its report.md) is removed;
    any other non-empty folder is left alone, and training then refuses it with its own message."""
    if (folder / "report.md").is_file():
        print(f"   replacing the earlier demo run in {folder}", flush=True)
        shutil.rmtree(folder)
