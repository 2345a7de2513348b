"""A CNN's recipe planned from measurement (``scheme="w8a8"``) against uniform pruning and a random plan of the same
size, each after the same QAT: Hugging Face's ResNet (basic blocks, a small config) or MobileNetV2
(``--model mobilenet``), random initial weights, trained on scikit-learn's digits (8x8 upscaled to 32x32), each
convolution and the classifier in int8 (weights and inputs) or float, each channel space between them (a block's
inner channels; MobileNetV2's residual streams too) pruned by 25%, 50% or 75% or not.

Plans, within ``--share`` of uniform int8's bytes: recal's plan from the measured loss increase (each layer alone in
recal's QAT, each space alone pruned); from the cheap (Fisher) estimate; uniform pruning (every space at the least
level that fits, every layer int8); a random plan (random levels and precisions, the largest of 2,000 draws that
fits); with uniform int8 unpruned (larger) as the reference. Then at equal time: each layer's candidates timed in
onnxruntime on this CPU (``recal_onnx.timed_candidates``, one image, one thread), recal's plan and a random one
within uniform pruning's summed time. Each is QAT-trained ``--qat-steps`` steps under its recipe, thinned,
exported, converted by ``quantize_qat_export``, and judged in onnxruntime on the 360 held-out digits (accuracy and
cross-entropy), with its size, its layers' summed time as planned and the whole model's measured time for one image.

    python scripts/bench_plan_cnn.py [--model resnet|mobilenet] [--seeds 0 1 2] [--json docs/results/plan_cnn.json]
"""

from __future__ import annotations

import argparse
import copy
import os
import random
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from bench.results import machine, report
from bench.suite import suite_module
from bench.timing import interleaved_latency
from recal_core import load_digits, precision_plan
from recal_onnx import UnconvertedOpsWarning, quantize_qat_export, timed_candidates
from recal_torch import ScheduledModifierManager, export_onnx, measure_precision, thin

PRUNE_LEVELS = (0.25, 0.5, 0.75)
SIZE = 32
HF = suite_module("tests.e2e.zoo.test_cnns").HF  # a transformers classifier called on images, its logits out
LR = "    - !LearningRateFunctionModifier {start_epoch: 0, end_epoch: 1, lr_func: cosine, init_lr: 0.0005, " \
     "final_lr: 0.00005}\n"  # the QAT's LR, the same for every plan


def build(name: str = "resnet") -> torch.nn.Module:
    """transformers' ResNet (basic blocks, hidden sizes 16-128) or MobileNetV2 (width 0.35: depthwise blocks,
    TensorFlow-style padding), 10 classes, random initial weights."""
    import transformers

    if name == "mobilenet":
        return HF(transformers.MobileNetV2ForImageClassification(transformers.MobileNetV2Config(
            image_size=SIZE, depth_multiplier=0.35, num_labels=10)))
    return HF(transformers.ResNetForImageClassification(transformers.ResNetConfig(
        embedding_size=16, hidden_sizes=[16, 32, 64, 128], depths=[1, 1, 1, 1], layer_type="basic", num_labels=10)))


MODELS = {"resnet": "transformers' ResNet (basic blocks, hidden sizes 16-128",
          "mobilenet": "transformers' MobileNetV2 (width 0.35, depthwise blocks"}


def images(x: np.ndarray) -> torch.Tensor:
    """8x8 digits as 3x32x32 images."""
    t = torch.from_numpy(x)[:, None]
    return F.interpolate(t, size=SIZE, mode="bilinear", align_corners=False).repeat(1, 3, 1, 1)


def train(model, x, y, steps, lr, seed, manager=None, batch=64):
    g = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    if manager is not None:
        optimizer = manager.modify(model, optimizer, steps_per_epoch=steps, example_inputs=(x[:2],))
    model.train()
    for step in range(steps):
        idx = torch.randint(0, len(y), (batch,), generator=g)
        optimizer.zero_grad()
        F.cross_entropy(model(x[idx]), y[idx]).backward()
        optimizer.step()
    if manager is not None:
        manager.finalize(model)
    model.eval()


def judged(path: Path, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    """Accuracy and mean cross-entropy of the ONNX model at ``path`` in a default onnxruntime session."""
    import onnxruntime as ort

    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    name = session.get_inputs()[0].name
    logits = np.concatenate([session.run(None, {name: x[i:i + 1].numpy()})[0] for i in range(len(y))])
    t = torch.from_numpy(logits)
    return float((t.argmax(1) == y).float().mean()), float(F.cross_entropy(t, y))


def _uniform(layers, level):
    """Every layer int8, every pruning group at ``level``."""
    def pick(layer):
        return next(c for c in layer.candidates if c.bits == 8 and layer.levels(c) == {g: level for g in layer.levels(c)})
    return {layer.name: pick(layer) for layer in layers}


def _random(layers, budget, rng, cost="bytes", draws=2000):
    """The largest of ``draws`` random plans (a random level for each group, a random precision for each layer) that
    fits ``budget``."""
    groups = sorted({g for layer in layers for g in (layer.group, layer.in_group) if g})
    best = None
    for _ in range(draws):
        levels = {g: rng.choice((0.0, *PRUNE_LEVELS)) for g in groups}
        bits = {layer.name: rng.choice((8, precision_plan.FLOAT)) for layer in layers}
        choice = {layer.name: next(c for c in layer.candidates if c.bits == bits[layer.name]
                                   and all(levels[g] == s for g, s in layer.levels(c).items())) for layer in layers}
        spent = precision_plan.total(choice, cost)
        if spent <= budget and (best is None or spent > best[0]):
            best = (spent, choice)
    if best is None:
        raise SystemExit(f"no random plan of {draws} fits {budget}")
    return best[1]


def run_seed(args, seed: int, data) -> dict:
    torch.manual_seed(seed)
    x, y = images(data.train_images), torch.from_numpy(data.train_labels)
    tx, ty = images(data.test_images), torch.from_numpy(data.test_labels)
    model = build(args.model)
    print(f"seed {seed}, fp32: {args.steps} steps", flush=True)
    train(model, x, y, args.steps, 2e-3, 10 * seed)
    g = torch.Generator().manual_seed(10 * seed + 7)
    calibration = [(x[idx], y[idx]) for idx in torch.randperm(len(y), generator=g)[:64 * args.calibration].split(64)]

    def loss_fn(m, b):
        return F.cross_entropy(m(b[0]), b[1])

    plans, seconds = {}, {}
    for score in ("measured", "fisher"):
        t0 = time.perf_counter()
        plans[score], left_out = measure_precision(model, calibration, loss_fn, score=score, scheme="w8a8",
                                                   prune_levels=PRUNE_LEVELS, progress=True)
        seconds[score] = time.perf_counter() - t0
    t0 = time.perf_counter()
    timed = {score: timed_candidates(layers, group_size=0, threads=1, cache=False) for score, layers in plans.items()}
    seconds["timing"] = time.perf_counter() - t0
    layers = timed["measured"]
    full = precision_plan.total(_uniform(layers, 0.0))
    budget = args.share * full
    level = next(s for s in PRUNE_LEVELS if precision_plan.total(_uniform(layers, s)) <= budget)
    uniform = _uniform(layers, level)
    uniform_ms = precision_plan.total(uniform, "latency")
    choices = {"uniform int8, unpruned (larger)": _uniform(layers, 0.0),
               f"uniform int8, every space {level:.0%} pruned": uniform,
               "recal plan (measured)": precision_plan.solve(layers, budget),
               "recal plan (fisher estimate)": precision_plan.solve(timed["fisher"], budget),
               "random plan": _random(layers, budget, random.Random(seed)),
               "recal plan at uniform's ms (measured)": precision_plan.solve(layers, uniform_ms, "latency"),
               "random plan at uniform's ms": _random(layers, uniform_ms, random.Random(seed), "latency")}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        paths = {}
        for label, choice in choices.items():
            print(f"seed {seed}, {label}: QAT {args.qat_steps} steps", flush=True)
            recipe = precision_plan.recipe_text(layers, choice) + LR
            student = copy.deepcopy(model)
            train(student, x, y, args.qat_steps, 5e-4, 10 * seed + 1, ScheduledModifierManager.from_yaml(recipe))
            thin(student, example_inputs=(x[:2],))
            qat = Path(tmp) / f"{len(paths)}.qat.onnx"
            export_onnx(student, x[:1], qat)
            with warnings.catch_warnings():  # the plan's float layers, float by design, are listed by the converter
                warnings.simplefilter("ignore", UnconvertedOpsWarning)
                result = quantize_qat_export(str(qat), Path(tmp) / f"{len(paths)}.onnx",
                                             inputs={"input": x[:8].numpy()})
            paths[label] = result.path
            accuracy, ce = judged(result.path, tx, ty)
            rows.append({"plan": label, "planned_bytes": precision_plan.total(choice),
                         "planned_ms": precision_plan.total(choice, "latency"),
                         "int8": sum(c.bits == 8 for c in choice.values()), "layers": len(choice),
                         "pruned": {g: s for layer in layers for g, s in layer.levels(choice[layer.name]).items()},
                         "accuracy": accuracy, "cross_entropy": ce, "file_bytes": result.path.stat().st_size})
        latency = interleaved_latency(paths, {"input": tx[:1].numpy()}, rounds=9, per_round=3, min_seconds=0.05)
    for row in rows:
        row["ms_image"] = latency[row["plan"]]
    return {"seed": seed, "budget_bytes": budget, "budget_ms": uniform_ms, "uniform_level": level,
            "planning_seconds": seconds, "layers_planned": len(layers), "left_out": left_out, "rows": rows}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1000,
                        help="fp32 training steps (batch 64): a converged model, as a user plans from")
    parser.add_argument("--qat-steps", type=int, default=150)
    parser.add_argument("--calibration", type=int, default=8, help="batches of 64 the plan is measured on")
    parser.add_argument("--share", type=float, default=0.6, help="the size budget, a share of uniform int8's bytes")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--model", choices=tuple(MODELS), default="resnet")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    data = load_digits()
    runs = [run_seed(args, seed, data) for seed in args.seeds]
    out = {**machine(), "seeds": args.seeds, "steps": args.steps, "qat_steps": args.qat_steps, "share": args.share,
           "calibration": args.calibration, "model": args.model, "runs": runs}
    return report(out, table(out), args.json)


def table(data: dict) -> str:
    """Each plan over the seeds: int8 layers (the first seed's), sizes, accuracy and cross-entropy (median,
    least-most), latency."""
    runs = data["runs"]
    lines = ["| plan | int8 layers | planned kB | file kB | accuracy | cross-entropy | planned ms | image ms |",
             "|---" * 8 + "|"]
    for i, first in enumerate(runs[0]["rows"]):
        rows = [run["rows"][i] for run in runs]
        acc, ce = [r["accuracy"] for r in rows], [r["cross_entropy"] for r in rows]
        pruned = [s for s in first["pruned"].values() if s]
        counts = f"{first['int8']} of {first['layers']}" + (
            f"; {len(pruned)} of {len(first['pruned'])} spaces pruned" if pruned else "")
        lines.append(f"| {first['plan']} | {counts} | {statistics.median(r['planned_bytes'] for r in rows) / 1e3:.1f} | "
                     f"{statistics.median(r['file_bytes'] for r in rows) / 1e3:.1f} | {statistics.median(acc):.3f} "
                     f"({min(acc):.3f}-{max(acc):.3f}) | {statistics.median(ce):.4f} ({min(ce):.4f}-{max(ce):.4f}) | "
                     f"{statistics.median(r['planned_ms'] for r in rows):.3f} | "
                     f"{statistics.median(r['ms_image'] for r in rows):.3f} |")
    return "\n".join(lines)


def wins(data: dict, plan: str, other: str, key: str = "cross_entropy") -> int:
    """In how many seeds ``plan``'s cross-entropy is below ``other``'s."""
    values = [{r["plan"]: r[key] for r in run["rows"]} for run in data["runs"]]
    return sum(v[plan] < v[other] for v in values)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "2")
    sys.exit(main())
