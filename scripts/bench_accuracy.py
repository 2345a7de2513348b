"""Accuracy on the digits test set: dense vs GradualKS 90% vs GradualKS 90% + QAT -> int8 ONNX (observed scales,
and learned ones: LSQ).

Three seeds each; pruning rows in both frameworks. Prints mean and spread, and checks the goals:
90% sparsity within 1.0 point of dense, int8 within 1.5 points of dense, TF and PyTorch pruned
accuracies within 1.5 points of each other.

    python scripts/bench_accuracy.py [--seeds 0 1 2] [--output runs/bench_accuracy] [--rows QAT] [--json F]

``--rows QAT --json docs/results/digits_int8.json`` saves the int8 rows (observed and learned scales) that
docs/decoders.md shows beside the decoder's.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from recal_core import load_recipe
from recal_app import train

from bench.results import machine, save

RECIPES = Path(__file__).resolve().parent.parent / "recal_core" / "recipes"
ROWS = [  # label, framework, recipe, artefact name prefix
    ("dense", "torch", "dense.yaml", "PyTorch model"),
    ("dense", "tf", "dense.yaml", "TensorFlow frozen graph"),
    ("GradualKS 90%", "torch", "prune90.yaml", "PyTorch model"),
    ("GradualKS 90%", "tf", "prune90.yaml", "TensorFlow frozen graph"),
    ("GradualKS 90% + QAT -> int8 ONNX", "torch", "prune90_quant.yaml", "int8 ONNX"),
    ("GradualKS 90% + QAT (lsq) -> int8 ONNX", "torch", "prune90_quant_lsq.yaml", "int8 ONNX"),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--output", default=None, help="keep the runs here (default: a temp folder)")
    parser.add_argument("--rows", nargs="+", help="only the rows whose label holds one of these (goals need all)")
    parser.add_argument("--json", type=Path, help="also write the rows' accuracies here")
    args = parser.parse_args()
    root = Path(args.output or tempfile.mkdtemp(prefix="recal-accuracy-"))
    results: dict[tuple[str, str], list[tuple[float, float]]] = {}
    for label, framework, recipe_name, prefix in ROWS:
        if args.rows and not any(part in label for part in args.rows):
            continue
        for seed in args.seeds:
            folder = root / f"{framework}-{recipe_name.split('.')[0]}-seed{seed}"
            run = train(load_recipe(RECIPES / recipe_name), framework, folder, seed=seed, progress=False)
            artefact = next(a for a in run.artefacts if a.name.startswith(prefix))
            results.setdefault((label, framework), []).append((artefact.accuracy, artefact.sparsity))
            print(f"{label:40s} {framework:5s} seed {seed}: accuracy {artefact.accuracy:.4f} "
                  f"sparsity {artefact.sparsity:.3f}", flush=True)

    def mean(label, framework):
        return 100 * statistics.fmean(a for a, _ in results[(label, framework)])

    print(f"\ndigits test set (360 images), seeds {args.seeds}, accuracy in %")
    print(f"{'run':40s} {'framework':9s} {'mean':>7s} {'min':>7s} {'max':>7s} {'sparsity':>8s}")
    for (label, framework), values in results.items():
        accs = [100 * a for a, _ in values]
        print(f"{label:40s} {framework:9s} {statistics.fmean(accs):7.2f} {min(accs):7.2f} {max(accs):7.2f} "
              f"{statistics.fmean(s for _, s in values):8.3f}")
    if args.json:
        save(args.json, {**machine(), "seeds": args.seeds, "rows": [
            {"label": label, "framework": framework, "recipe": next(r for lb, fw, r, _ in ROWS
                                                                    if (lb, fw) == (label, framework)),
             "accuracy": [a for a, _ in values], "sparsity": statistics.fmean(s for _, s in values)}
            for (label, framework), values in results.items()]})
    if args.rows:
        print(f"\nruns in {root}")
        return
    goals = [
        ("torch 90% sparse within 1.0 pt of dense", mean("dense", "torch") - mean("GradualKS 90%", "torch"), 1.0),
        ("tf 90% sparse within 1.0 pt of dense", mean("dense", "tf") - mean("GradualKS 90%", "tf"), 1.0),
        ("int8 within 1.5 pt of dense", mean("dense", "torch") - mean("GradualKS 90% + QAT -> int8 ONNX", "torch"), 1.5),
        ("tf vs torch pruned within 1.5 pt", abs(mean("GradualKS 90%", "tf") - mean("GradualKS 90%", "torch")), 1.5),
    ]
    print("\ngoal                                        gap (pt)  limit  met")
    for name, gap, limit in goals:
        print(f"{name:43s} {gap:8.2f} {limit:6.1f}  {'yes' if gap <= limit else 'NO'}")
    print(f"\nruns in {root}")


if __name__ == "__main__":
    main()
