"""`make demo`: the whole promise, in a few minutes on 2 cores.

Accuracy on real data (the bundled digits):
1. a dense baseline in PyTorch (scripts/recipes/dense.yaml);
2. one recipe (scripts/recipes/prune_quant.yaml: GradualKS to 85% on every conv/dense kernel, then
   QAT, with an LR schedule) in PyTorch -> QAT ONNX -> int8 ONNX (quantize_qat_export);
3. the same recipe, QAT included, in the TensorFlow graph API -> QAT ONNX -> int8 ONNX.
Speed on a realistic architecture (synthetic inputs; the digits net is too small for int8 kernels to pay):
4. a ResNet-18-shaped model at 224x224, QAT a few steps, converted: fp32 vs recal int8 vs onnxruntime's
   quantize_static vs recal with half the filters pruned and thinned, batch 1, one thread (scripts/speed.py).
Then the two tables and the paths of everything written.

    python scripts/demo.py [--output demo_out] [--seed 0] [--no-speed]
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from recal_core import load_recipe  # noqa: E402
from recal_core.training import train  # noqa: E402

RECIPES = Path(__file__).resolve().parent / "recipes"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", default="demo_out")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("--no-speed", action="store_true", help="skip the ResNet-18 speed part")
    args = parser.parse_args(argv)
    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    recipe = load_recipe(RECIPES / "prune_quant.yaml")
    jobs = [
        ("torch", "dense baseline", load_recipe(RECIPES / "dense.yaml"), out / "torch-dense"),
        ("torch", "prune 85% + QAT", recipe, out / "torch-prune-quant"),
        ("tf", "prune 85% + QAT (same recipe)", recipe, out / "tf-prune-quant"),
    ]
    rows = []
    started = time.perf_counter()
    for framework, label, job_recipe, folder in jobs:
        print(f"\n== {framework}: {label} ({job_recipe.source}) -> {folder}", flush=True)
        _replace_earlier_demo_run(folder)
        run = train(job_recipe, framework, folder, seed=args.seed, progress=not args.no_progress)
        rows += [(framework, label, a) for a in run.artefacts]
    speed_rows = []
    if not args.no_speed:
        import speed

        print(f"\n== speed: ResNet-18-shaped at 224x224 -> {out / 'speed'}", flush=True)
        speed_rows = speed.speed_table(out / "speed")
    print(f"\nrecal demo, {time.perf_counter() - started:.0f}s in all")
    print("\n1. accuracy on real data: the digits test set (360 images)\n")
    header = f"{'framework':9s} {'run':32s} {'artefact':38s} {'accuracy':>8s} {'sparsity':>8s} {'size':>10s} {'latency':>10s}"
    print(header)
    print("-" * len(header))
    for framework, label, a in rows:
        print(f"{framework:9s} {label:32s} {a.name:38s} {a.accuracy:8.4f} {a.sparsity:8.3f} "
              f"{a.size_bytes / 1024:8.1f}KB {a.latency_ms:8.3f}ms")
    print("\nlatency: median batch-1 inference in the artefact's runtime (PyTorch, TensorFlow or onnxruntime)")
    if speed_rows:
        print("\n2. speed on synthetic inputs: ResNet-18-shaped, 224x224, onnxruntime, batch 1, 1 thread, "
              "interleaved medians\n")
        print(speed.format_table(speed_rows))
        from recal_onnx import cpu

        print(cpu.describe())
    print("\noutputs:")
    for _, _, folder in [(None, None, j[3]) for j in jobs]:
        print(f"  {folder}/report.md  {folder}/schedule.png  {folder}/tensorboard/")
    for framework, label, a in rows:
        print(f"  {a.path}")
    for row in speed_rows:
        print(f"  {row.path}")
    print(f"view the training curves: tensorboard --logdir {out}")
    return 0


def _replace_earlier_demo_run(folder: Path) -> None:
    """A second `make demo` starts its jobs afresh: a folder holding an earlier demo job's run (its report.md) is
    removed; any other non-empty folder is left alone, and training then refuses it with its own message."""
    if (folder / "report.md").is_file():
        print(f"   replacing the earlier demo run in {folder}", flush=True)
        shutil.rmtree(folder)


if __name__ == "__main__":
    sys.exit(main())
