"""What 7-bit weights cost: digits int8 accuracy with ``reduce_range: true`` against 8-bit weights, per front end.

The demo's recipe (``recal:prune_quant``: GradualKS to 85%, then QAT) is trained on the digits in
PyTorch, the TensorFlow graph API and Keras, once as written (``reduce_range: true``) and once with 8-bit weights,
for each seed; the int8 ONNX model's accuracy on the 360 test digits is read off each run. Prints one table and
writes the runs' figures as JSON.

    python scripts/bench_reduce_range.py [--seeds 0 1 2] [--frameworks torch tf keras] [--json out.json]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from recal_core import load_recipe
from recal_app import train

from bench.results import machine, save

RECIPE = Path(__file__).resolve().parent.parent / "recal_core" / "recipes" / "prune_quant.yaml"
SEVEN_BIT = "reduce_range: true"


def int8_accuracy(framework: str, reduce_range: bool, seed: int, folder: Path) -> float:
    text = RECIPE.read_text()
    assert SEVEN_BIT in text, f"{RECIPE} no longer sets {SEVEN_BIT}"
    if not reduce_range:
        text = text.replace(SEVEN_BIT, "reduce_range: false")
    run = train(load_recipe(text), framework, folder, seed=seed, progress=False)
    (int8,) = [a for a in run.artefacts if a.name.startswith("int8")]
    return int8.accuracy


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--frameworks", nargs="+", default=["torch", "tf", "keras"])
    parser.add_argument("--json", type=Path, help="write the figures here")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="recal-reduce-range-"))
    rows = []
    for framework in args.frameworks:
        for seed in args.seeds:
            for reduce_range in (False, True):
                accuracy = int8_accuracy(framework, reduce_range, seed, root / f"{framework}-{seed}-{reduce_range}")
                rows.append({"framework": framework, "seed": seed, "reduce_range": reduce_range,
                             "int8_accuracy": accuracy})
                print(f"  {framework} seed {seed} {'7-bit' if reduce_range else '8-bit'}: int8 accuracy "
                      f"{accuracy:.4f}", flush=True)
    print(f"\ndigits int8 accuracy, {RECIPE.name}, mean of seeds {args.seeds} (360 test images)\n")
    print("| front end | 8-bit weights | 7-bit weights (reduce_range) | 7-bit - 8-bit (points) |")
    print("|---|---|---|---|")
    for framework in args.frameworks:
        mean = {r: statistics.mean(x["int8_accuracy"] for x in rows if x["framework"] == framework
                                   and x["reduce_range"] == r) for r in (False, True)}
        print(f"| {framework} | {100 * mean[False]:.2f}% | {100 * mean[True]:.2f}% | "
              f"{100 * (mean[True] - mean[False]):+.2f} |")
    if args.json:
        save(args.json, {"recipe": RECIPE.name, "seeds": args.seeds, **machine(), "rows": rows})


if __name__ == "__main__":
    main()
