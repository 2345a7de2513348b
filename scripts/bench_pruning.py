"""Pruning methods on the digits: 90% magnitude (GMP), global magnitude, OBS and M-FAC vs 2:4, one table.

Each variant is recal:prune90 with its GradualKS swapped (same schedule, LR and epochs);
three seeds each, PyTorch, test accuracy of the trained model, and the time per training step (a run's
wall time over its steps, per-epoch evaluation included) against the dense run's.

    python scripts/bench_pruning.py [--seeds 0 1 2] [--output runs/bench_pruning]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from recal_core import load_recipe
from recal_app import train

RECIPES = Path(__file__).resolve().parent.parent / "recal_core" / "recipes"
GMP = RECIPES / "prune90.yaml"
VARIANTS = {  # label -> (the GradualKS block's replacement lines, or None for the recipe as it is)
    "dense": "dense",
    "GMP 90% (per layer)": None,
    "global magnitude 90%": ("        update_frequency: 0.5", "        update_frequency: 0.5\n        global_sparsity: true"),
    "OBS 90% (per layer)": ("    - !GradualKSModifier", "    - !OBSPruningModifier\n        num_grads: 16\n"
                            "        fisher_block_size: 32\n        damp: 1.0e-6"),
    "M-FAC 90% (per layer)": ("    - !GradualKSModifier", "    - !MFACPruningModifier\n        num_grads: 16\n"
                              "        damp: 1.0e-6"),
    "2:4 (50%; conv2, conv3, fc)": [("        params: __ALL_PRUNABLE__", "        params: [conv2, conv3, fc]"),
                                    ("        final_sparsity: 0.9", "        final_sparsity: 0.5"),
                                    ("        update_frequency: 0.5", "        update_frequency: 0.5\n        mask_type: '2:4'")],
}


def recipe_text(change) -> str:
    if change == "dense":
        return (RECIPES / "dense.yaml").read_text()
    text = GMP.read_text()
    for old, new in ([] if change is None else [change] if isinstance(change, tuple) else change):
        assert old in text, old
        text = text.replace(old, new, 1)
    return text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--output", default=None)
    args = parser.parse_args()
    root = Path(args.output or tempfile.mkdtemp(prefix="recal-pruning-"))
    rows = {}
    for label, change in VARIANTS.items():
        path = root / f"{label.split()[0].replace(':', '-')}.yaml"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(recipe_text(change))
        for seed in args.seeds:
            started = time.perf_counter()
            run = train(load_recipe(path), "torch", root / f"{path.stem}-seed{seed}", seed=seed, progress=False,
                        quantize=False)
            seconds = time.perf_counter() - started
            model = next(a for a in run.artefacts if a.name.startswith("PyTorch model"))
            steps = run.epochs * run.steps_per_epoch
            rows.setdefault(label, []).append((model.accuracy, model.sparsity, 1e3 * seconds / steps))
            print(f"{label:30s} seed {seed}: accuracy {model.accuracy:.4f}, sparsity {model.sparsity:.3f}, "
                  f"{1e3 * seconds / steps:.1f} ms/step", flush=True)
    base = statistics.median(ms for _, _, ms in rows["dense"])
    print(f"\ndigits test set (360 images), PyTorch, seeds {args.seeds}")
    print(f"{'method':30s} {'accuracy %':>10s} {'min':>6s} {'max':>6s} {'sparsity':>8s} {'ms/step':>8s} {'vs dense':>8s}")
    for label, values in rows.items():
        accs = [100 * a for a, _, _ in values]
        ms = statistics.median(m for _, _, m in values)
        print(f"{label:30s} {statistics.fmean(accs):10.2f} {min(accs):6.2f} {max(accs):6.2f} "
              f"{statistics.fmean(s for _, s, _ in values):8.3f} {ms:8.1f} {100 * (ms / base - 1):+7.1f}%")
    print(f"\nruns in {root}")


if __name__ == "__main__":
    main()
