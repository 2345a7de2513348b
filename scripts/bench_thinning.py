"""Filter pruning and thinning: accuracy on the digits and latency of a ResNet-18 at 224x224, one table.

Digits (PyTorch, ``recal train``'s pipeline, 3 seeds): dense fp32; 50% of the filters + QAT, thinned, int8;
the same plus unstructured pruning of the kept weights (75% in all: half of what filter pruning keeps).
ResNet-18 (random weights, a few float steps, the pruning at step 0, a few QAT steps on synthetic data;
onnxruntime, batch 1, one thread, the models taking turns, medians): dense fp32; dense int8 by
onnxruntime's ``quantize_static``; the two recal variants, thinned (``recal_torch.thin``), exported and
converted by ``quantize_qat_export``.

    python scripts/bench_thinning.py [--seeds 0 1 2] [--size 224] [--rounds 15] [--output runs/bench_thinning]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import tempfile
from pathlib import Path

import torch

from recal_core import load_recipe
from recal_app import train
from recal_onnx import cpu
from recal_torch import count_macs, export_onnx

from bench.peers import quantize_static
from bench.timing import interleaved_latency
from speed import FILTERS_RECIPE, qat_int8
from bench.models import ResNet18, templates, train_steps

RECIPES = Path(__file__).resolve().parent.parent / "recal_core" / "recipes"
FILTERS = RECIPES / "filters50_quant.yaml"
UNSTRUCTURED = """
    - !GradualKSModifier
        params: [conv1, conv2, conv3]
        init_sparsity: 0.05
        final_sparsity: 0.75
        start_epoch: 1.0
        end_epoch: 8.0
        update_frequency: 0.5
"""
RESNET_UNSTRUCTURED = ("- !GradualKSModifier {params: ['re:.*conv\\d', 're:.*down.0'], init_sparsity: 0.75, "
                       "final_sparsity: 0.75, start_epoch: 0, end_epoch: 1, update_frequency: 1}\n")


def digits_rows(root: Path, seeds: list[int]) -> dict[str, list[tuple[float, int]]]:
    """Per variant, (accuracy of the deployed model, its multiply-adds) per seed."""
    text = FILTERS.read_text()
    variants = {"dense fp32": (RECIPES / "dense.yaml").read_text(),
                "recal 50% filters + QAT, int8": text,
                "recal 50% filters + 50% of the rest + QAT, int8": text.replace("\n    - !QuantizationModifier",
                                                                                 UNSTRUCTURED + "\n    - !QuantizationModifier")}
    out: dict[str, list[tuple[float, int]]] = {}
    for label, recipe_text in variants.items():
        path = root / f"digits-{len(out)}.yaml"
        path.write_text(recipe_text)
        for seed in seeds:
            run = train(load_recipe(path), "torch", root / f"{path.stem}-seed{seed}", seed=seed, progress=False)
            deployed = run.artefacts[-1]  # the int8 model, or the fp32 export of the dense run
            torch_model = run.artefacts[1 if "thinned" in run.artefacts[1].name else 0]
            out.setdefault(label, []).append((deployed.accuracy, torch_model.macs))
            print(f"  digits {label}, seed {seed}: {deployed.name} accuracy {deployed.accuracy:.4f}, "
                  f"{torch_model.macs / 1e6:.3f} M MACs", flush=True)
    return out


def resnet_models(folder: Path, size: int, float_steps: int = 3, qat_steps: int = 4, batch: int = 8):
    """The ResNet-18 variants as ONNX files, their MACs, and an input."""
    sample = templates((3, size, size), 10)
    one = sample(1)[0]
    torch.manual_seed(0)
    model = ResNet18(classes=10)
    train_steps(model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9), sample, float_steps, batch)
    dense, qs = "dense fp32", "dense int8 (onnxruntime quantize_static)"
    qs7 = "dense int8 (onnxruntime quantize_static, reduce_range)"
    paths = {dense: folder / "dense.fp32.onnx", qs: folder / "dense.quantize_static.onnx",
             qs7: folder / "dense.quantize_static.reduce_range.onnx"}
    export_onnx(model.eval(), one, paths[dense], dynamo=False)
    macs = {dense: count_macs(model, one)[0]}
    macs[qs] = macs[qs7] = macs[dense]
    calibration = [{"input": sample(1)[0].numpy()} for _ in range(8)]
    quantize_static(paths[dense], paths[qs], calibration)
    quantize_static(paths[dense], paths[qs7], calibration, reduce_range=True)
    unstructured = FILTERS_RECIPE.replace("- !QuantizationModifier", RESNET_UNSTRUCTURED + "- !QuantizationModifier")
    for label, recipe in (("recal 50% filters + QAT int8, thinned", FILTERS_RECIPE),
                          ("recal 50% filters + 50% of the rest + QAT int8, thinned", unstructured)):
        paths[label], macs[label], _ = qat_int8(copy.deepcopy(model), recipe, sample, folder, f"resnet18-{len(paths)}",
                                             qat_steps, batch)
    return paths, macs, {"input": one.numpy()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--output", default=None)
    args = parser.parse_args()
    root = Path(args.output or tempfile.mkdtemp(prefix="recal-thinning-"))
    root.mkdir(parents=True, exist_ok=True)
    digits = digits_rows(root, args.seeds)
    paths, macs, feed = resnet_models(root, args.size)
    latency = interleaved_latency(paths, feed, args.rounds)

    print(f"\ndigits test set (360 images), PyTorch -> ONNX, seeds {args.seeds}")
    print(f"{'variant':50} {'accuracy %':>10} {'min':>6} {'max':>6} {'MACs':>9}")
    for label, rows in digits.items():
        accs = [a * 100 for a, _ in rows]
        print(f"{label:50} {statistics.median(accs):10.2f} {min(accs):6.2f} {max(accs):6.2f} "
              f"{rows[0][1] / 1e6:7.3f} M")
    print(f"\nResNet-18 at {args.size}x{args.size}, onnxruntime, batch 1, 1 thread, median of {args.rounds} "
          "interleaved rounds")
    print(f"{'model':58} {'ms':>8} {'vs fp32':>8} {'vs qs':>6} {'GMACs':>6} {'MB':>6}")
    fp32, qs = latency["dense fp32"], latency["dense int8 (onnxruntime quantize_static)"]
    for label, path in paths.items():
        print(f"{label:58} {latency[label]:8.2f} {fp32 / latency[label]:7.2f}x {qs / latency[label]:5.2f}x "
              f"{macs[label] / 1e9:6.2f} {path.stat().st_size / 1e6:6.1f}")
    print(f"\n{cpu.describe()}\nruns in {root}")


if __name__ == "__main__":
    main()
