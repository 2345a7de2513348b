"""A recipe planned from measurement against uniform precision and a random plan of the same size, each after the
same QAT: a Llama-shaped decoder over bytes trained on the Python standard library's source (scripts/bench_llm.py's
model and data), its Linear layers' weights in 8, 4 or 2 bits (weight-only, groups of 32) or float.

Plans, at a budget halfway between the sizes of uniform 2-bit and uniform 4-bit weights (``--between``): recal's plan
from the measured loss increase; from the cheap (Fisher) estimate; a random plan (each layer's bits drawn, then
layers moved to fewer bits until the plan fits); with uniform int2 (smaller) and int4 (larger) as the bounds. Then at
equal latency: each layer's candidates timed in onnxruntime on this CPU (``recal_onnx.timed_candidates``, one
token, one thread), recal's plan and a random one under uniform int4's summed time; and within the size budget and
a time halfway between the size plan's and the fastest plan's of that size, which no uniform precision meets:
recal's plans and a random one (from the fastest plan within the size, each layer in a random order moved to a
random candidate where both caps still hold). At the size budget, recal's plan once more with pruning candidates
too: each MLP's hidden channels pruned by 25% or 50% (``prune_levels``), planned with the precision, the pruned
channels thinned after QAT. Each is trained ``--qat-steps`` steps
under its recipe, exported, converted by ``quantize_qat_export``, and judged by perplexity on held-out files in
onnxruntime, with its size, its layers' summed time as planned and the whole model's measured time for one token.

    python scripts/bench_plan.py [--seeds 0 1 2] [--json docs/results/plan.json]
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from bench.results import machine, report
from bench.timing import interleaved_latency
from bench_llm import SEQ, batches, build, corpus, perplexity, train
from examples.int4_decoder import Logits
from recal_core import precision_plan
from recal_onnx import quantize_qat_export, timed_candidates
from recal_torch import ScheduledModifierManager, export_onnx, measure_precision, thin

ROOT = Path(__file__).resolve().parent.parent


PRUNE_LEVELS = (0.25, 0.5)  # the shares of each MLP's hidden channels the "pruning too" plans may remove
LR = "    - !LearningRateFunctionModifier {start_epoch: 0, end_epoch: 1, lr_func: cosine, init_lr: 0.0002, " \
     "final_lr: 0.00002}\n"  # the QAT's LR, the same for every plan


def _uniform(layers, bits):
    return {layer.name: next(c for c in layer.candidates if c.bits == bits) for layer in layers}


def _random(layers, budget, rng, cost="bytes"):
    """Each layer's candidate drawn at random, then the costliest layers (bytes, or ms) moved down a step until the
    plan fits."""
    value = (lambda c: c.cost) if cost == "bytes" else (lambda c: c.latency)
    choice = {layer.name: rng.choice(layer.candidates) for layer in layers}
    by_name = {layer.name: layer for layer in layers}
    while sum(map(value, choice.values())) > budget:
        movable = [n for n in choice if any(value(c) < value(choice[n]) for c in by_name[n].candidates)]
        name = max(movable, key=lambda n: value(choice[n]))  # the costliest layer that can still go down a step
        cheaper = [c for c in by_name[name].candidates if value(c) < value(choice[name])]
        choice[name] = max(cheaper, key=value)
    return choice


def _random_within(layers, size, ms, rng):
    """A random plan within both caps that uses them: from the fastest plan within ``size``, each layer in a random
    order moved to a random candidate where the plan stays within both."""
    choice = precision_plan.cheapest(layers, "latency", {"bytes": size})
    for layer in rng.sample(layers, len(layers)):
        for candidate in rng.sample(layer.candidates, len(layer.candidates)):
            tried = {**choice, layer.name: candidate}
            if precision_plan.total(tried) <= size and precision_plan.total(tried, "latency") <= ms:
                choice = tried
                break
    return choice


def _point(choice) -> dict:
    bits = [c.bits for c in choice.values()]
    return {"bytes": precision_plan.total(choice), "ms": precision_plan.total(choice, "latency"),
            "score": precision_plan.total(choice, "score"), "bits": {str(b): bits.count(b) for b in sorted(set(bits))}}


def run_seed(args, seed: int, train_data: np.ndarray, test_data: np.ndarray) -> dict:
    """One seed: the fp32 model trained, each plan made, QAT-trained, converted and judged."""
    torch.manual_seed(seed)
    windows = np.stack([test_data[i * (SEQ + 1):(i + 1) * (SEQ + 1)] for i in range(128)])
    model = build(args.layers, args.hidden)
    print(f"seed {seed}, fp32: {args.steps} steps", flush=True)
    train(model, train_data, args.steps, 2e-3, args.batch, seed=10 * seed)
    model.eval()
    calibration = [b for _, b in zip(range(args.calibration), batches(train_data, args.batch, 10 * seed + 7))]

    def loss_fn(m, b):
        logits = m(input_ids=b[0], use_cache=False).logits
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), b[1].reshape(-1))

    plans, seconds = {}, {}
    for score, levels in (("measured", ()), ("fisher", ()), ("pruned", PRUNE_LEVELS)):
        t0 = time.perf_counter()
        plans[score], _ = measure_precision(model, calibration, loss_fn, score="fisher" if score == "fisher" else
                                            "measured", prune_levels=levels, progress=True)
        seconds[score] = time.perf_counter() - t0
    t0 = time.perf_counter()
    timed = timed_candidates(plans["pruned"], rows=1, threads=1, cache=False)  # one token, as ms_token is measured
    seconds["timing"] = time.perf_counter() - t0
    ms = {(layer.name, c.bits, c.kept): c.latency for layer in timed for c in layer.candidates}
    plans = {score: [dataclasses.replace(layer, candidates=tuple(
        dataclasses.replace(c, latency=ms[layer.name, c.bits, c.kept]) for c in layer.candidates)) for layer in layers]
        for score, layers in plans.items()}
    layers, pruned = plans["measured"], plans["pruned"]
    int2, int4 = (sum(c.cost for c in _uniform(layers, b).values()) for b in (2, 4))
    fast = precision_plan.total(_uniform(layers, 4), "latency")  # uniform int4's summed time: the latency budget
    budget = int2 + (int4 - int2) * args.between  # between uniform int2 and int4: where a plan has choices to make
    sized = precision_plan.solve(plans["measured"], budget)
    both = {"bytes": budget}  # and a time between the size plan's and the fastest plan's within that size
    quick = precision_plan.total(precision_plan.cheapest(layers, "latency", both), "latency")
    both_ms = (quick + precision_plan.total(sized, "latency")) / 2
    choices = {"uniform int2 (smaller)": _uniform(layers, 2), "uniform int4 (larger)": _uniform(layers, 4),
               "recal plan (measured)": sized,
               "recal plan (fisher estimate)": precision_plan.solve(plans["fisher"], budget),
               "random plan": _random(layers, budget, random.Random(seed)),
               "recal plan, pruning too (measured)": precision_plan.solve(pruned, budget),
               "recal plan at int4's ms (measured)": precision_plan.solve(plans["measured"], fast, "latency"),
               "random plan at int4's ms": _random(layers, fast, random.Random(seed), "latency"),
               "recal plan within size and ms (measured)": precision_plan.solve(layers, both_ms, "latency",
                                                                                within=both),
               "recal plan within size and ms (fisher estimate)": precision_plan.solve(plans["fisher"], both_ms,
                                                                                       "latency", within=both),
               "random plan within size and ms": _random_within(layers, budget, both_ms, random.Random(seed))}
    curves = {cost: [_point(choice) for _, _, choice in precision_plan.pareto(layers, points=8, cost=cost)]
              for cost in ("bytes", "latency")}  # the measured score's best plan across each range
    sample = torch.from_numpy(windows[:2, :SEQ].astype(np.int64))
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        paths = {}
        for label, choice in choices.items():
            print(f"seed {seed}, {label}: QAT {args.qat_steps} steps", flush=True)
            recipe = precision_plan.recipe_text(pruned if "pruning" in label else layers, choice) + LR
            student = copy.deepcopy(model)
            train(student, train_data, args.qat_steps, 2e-4, args.batch, seed=10 * seed + 1,
                  manager=ScheduledModifierManager.from_yaml(recipe))
            if any(c.sparsity for c in choice.values()):
                thin(student.eval())  # the pruned channels out: smaller layers
            qat = Path(tmp) / f"{len(paths)}.qat.onnx"
            export_onnx(Logits(student).eval(), sample, qat, input_names=["ids"], output_names=["logits"],
                        dynamic_sequence=True)
            result = quantize_qat_export(str(qat), Path(tmp) / f"{len(paths)}.onnx", inputs={"ids": sample.numpy()})
            paths[label] = result.path
            bits = [c.bits for c in choice.values()]
            pruned_share = {name: c.sparsity for name, c in choice.items() if c.sparsity}
            rows.append({"plan": label, "planned_bytes": sum(c.cost for c in choice.values()), "pruned": pruned_share,
                         "planned_ms": precision_plan.total(choice, "latency"),
                         "bits": {str(b): bits.count(b) for b in sorted(set(bits))},
                         "ppl": perplexity(result.path, windows), "file_bytes": result.path.stat().st_size})
        token = {"ids": windows[:1, :1].astype(np.int64)}
        latency = interleaved_latency(paths, token, rounds=9, per_round=3, min_seconds=0.05)
    for row in rows:
        row["ms_token"] = latency[row["plan"]]
    measured, fisher = choices["recal plan (measured)"], choices["recal plan (fisher estimate)"]
    agree = sum(measured[name].bits == fisher[name].bits for name in measured)
    return {"seed": seed, "budget_bytes": budget, "budget_ms": fast, "both_ms": both_ms, "curves": curves, "planning_seconds": seconds,
            "layers_planned": len(layers), "plans_agree_on": agree, "rows": rows}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=400, help="fp32 training steps")
    parser.add_argument("--qat-steps", type=int, default=100)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--calibration", type=int, default=4, help="batches the plan is measured on")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2],
                        help="each seed: the fp32 model's initial weights and data order, the calibration batches, "
                             "the random plan")
    parser.add_argument("--between", type=float, default=0.5,
                        help="the budget, as a point between uniform int2's size (0) and uniform int4's (1)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    train_data, test_data, _ = corpus(4_000_000, 129 * (SEQ + 1))  # read once: the same bytes for every seed
    runs = [run_seed(args, seed, train_data, test_data) for seed in args.seeds]
    data = {**machine(), "seeds": args.seeds, "hidden": args.hidden, "layers": args.layers, "steps": args.steps,
            "qat_steps": args.qat_steps, "between": args.between, "runs": runs}
    return report(data, table(data), args.json)


def table(data: dict) -> str:
    """Each plan over the seeds: its bits (the first seed's), sizes, perplexity (median, least-most) and latency."""
    runs = data["runs"]
    lines = ["| plan | weights at 8 / 4 / 2 bits / float | planned kB | file kB | perplexity | planned ms | token ms |",
             "|---" * 7 + "|"]
    for i, first in enumerate(runs[0]["rows"]):
        rows = [run["rows"][i] for run in runs]
        counts = " / ".join(str(first["bits"].get(str(b), 0)) for b in (8, 4, 2, precision_plan.FLOAT))
        shares = sorted(set(first.get("pruned", {}).values()))
        if shares:
            counts += f"; {len(first['pruned'])} thinned by {' or '.join(f'{x:.0%}' for x in shares)}"
        ppl = [r["ppl"] for r in rows]
        spread = f" ({min(ppl):.4f}-{max(ppl):.4f})" if len(rows) > 1 else ""
        lines.append(f"| {first['plan']} | {counts} | {statistics.median(r['planned_bytes'] for r in rows) / 1e3:.1f} | "
                     f"{statistics.median(r['file_bytes'] for r in rows) / 1e3:.1f} | {statistics.median(ppl):.4f}"
                     f"{spread} | {statistics.median(r['planned_ms'] for r in rows):.3f} | "
                     f"{statistics.median(r['ms_token'] for r in rows):.3f} |")
    return "\n".join(lines)


def wins(data: dict, plan: str, other: str) -> int:
    """In how many seeds ``plan``'s perplexity is below ``other``'s."""
    ppl = [{r["plan"]: r["ppl"] for r in run["rows"]} for run in data["runs"]]
    return sum(p[plan] < p[other] for p in ppl)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "2")
    sys.exit(main())
