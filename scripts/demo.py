"""`make demo`: the whole promise on the bundled digits, in a few minutes on 2 cores.

1. a dense baseline in PyTorch (scripts/recipes/dense.yaml);
2. one recipe (scripts/recipes/prune_quant.yaml: GradualKS to 85% on every conv/dense kernel, then
   QAT, with an LR schedule) in PyTorch -> QAT ONNX -> int8 ONNX (quantize_qat_export);
3. the same recipe's pruning part in TensorFlow (the recipe minus its QuantizationModifier);
then one comparison table and the paths of everything written.

    python scripts/demo.py [--output demo_out] [--seed 0]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from recal_core import QuantizationModifier, load_recipe
from recal_core.atomic import write_text_atomically
from recal_core.recipe import Recipe
from recal_core.training import train

RECIPES = Path(__file__).resolve().parent / "recipes"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", default="demo_out")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    recipe = load_recipe(RECIPES / "prune_quant.yaml")
    pruning_only = Recipe(version=recipe.version,
                          modifiers=tuple(m for m in recipe.modifiers if not isinstance(m, QuantizationModifier)))
    write_text_atomically(out / "prune_quant.pruning-only.yaml", pruning_only.to_yaml())
    jobs = [
        ("torch", "dense baseline", load_recipe(RECIPES / "dense.yaml"), out / "torch-dense"),
        ("torch", "prune 85% + QAT", recipe, out / "torch-prune-quant"),
        ("tf", "prune 85% (same recipe, no QAT)", load_recipe(out / "prune_quant.pruning-only.yaml"), out / "tf-prune"),
    ]
    rows = []
    started = time.perf_counter()
    for framework, label, job_recipe, folder in jobs:
        print(f"\n== {framework}: {label} ({job_recipe.source}) -> {folder}", flush=True)
        run = train(job_recipe, framework, folder, seed=args.seed, progress=not args.no_progress)
        rows += [(framework, label, a) for a in run.artefacts]
    print(f"\nrecal demo: digits test set (360 images), {time.perf_counter() - started:.0f}s in all\n")
    header = f"{'framework':9s} {'run':32s} {'artefact':38s} {'accuracy':>8s} {'sparsity':>8s} {'size':>10s} {'latency':>10s}"
    print(header)
    print("-" * len(header))
    for framework, label, a in rows:
        print(f"{framework:9s} {label:32s} {a.name:38s} {a.accuracy:8.4f} {a.sparsity:8.3f} "
              f"{a.size_bytes / 1024:8.1f}KB {a.latency_ms:8.3f}ms")
    print("\nlatency: median batch-1 inference in the artefact's runtime (PyTorch, TensorFlow or onnxruntime)")
    print("outputs:")
    for _, _, folder in [(None, None, j[3]) for j in jobs]:
        print(f"  {folder}/report.md  {folder}/schedule.png  {folder}/tensorboard/")
    for framework, label, a in rows:
        print(f"  {a.path}")
    print(f"view the training curves: tensorboard --logdir {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
