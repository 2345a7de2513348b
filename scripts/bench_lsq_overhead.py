"""What learned quantization scales (``observer: lsq``) cost per training step, against observed scales and plain
training, in PyTorch on the CPU.

Two models, each variant stepped in turn (interleaved rounds, medians), QAT on from the first step (its plan is
made in the warm-up):

- a small ResNet (``bench_torch_overhead.py``'s, batch 32, 32x32) in W8A8: observed (minmax weights, moving-average
  activations) against learned (weights per channel and input activations);
- a Llama-shaped decoder (``bench_llm.py``'s, bytes as tokens, 8 x 128 tokens) with int4 weight-only layers in
  groups of 32: minmax, mse and learned scales;
- the same W8A8 pair on Keras (the TensorFlow backend): the digits net (``recal_app.keras_digits``), batch 128,
  timed per ``fit`` step (``bench/fit_timing.py``).

    python scripts/bench_lsq_overhead.py [--steps 40] [--threads 2] [--json docs/results/lsq_overhead.json]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch import nn

from recal_torch import ScheduledModifierManager

from bench.results import machine, save_run
from bench.timing import interleaved, medians
from bench_torch_overhead import SmallResNet, _step

W8A8 = {"observed": "- !QuantizationModifier {start_epoch: 0}",
        "learned": "- !QuantizationModifier {start_epoch: 0, scheme: {input_activations: {symmetric: false, "
                   "observer: lsq}, weights: {observer: lsq}}}"}
INT4 = ("- !QuantizationModifier {start_epoch: 0, scheme: {input_activations: null, weights: {num_bits: 4, "
        "group_size: 32, observer: %s}}}")


def _setup(model: nn.Module, recipe: str | None) -> torch.optim.Optimizer:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    if recipe is None:
        return optimizer
    return ScheduledModifierManager.from_yaml(recipe).modify(model, optimizer, steps_per_epoch=1000)


def _cnn(recipe: str | None):
    torch.manual_seed(0)
    model = SmallResNet()
    optimizer = _setup(model, recipe)
    x, y = torch.randn(32, 3, 32, 32), torch.randint(0, 10, (32,))
    return lambda: _step(model, optimizer, x, y)


def _decoder(recipe: str | None):
    import bench_llm

    torch.manual_seed(0)
    lm = bench_llm.build(2, 128)
    optimizer = _setup(lm, recipe)
    ids = torch.randint(0, 256, (8, 129))

    def step():
        optimizer.zero_grad()
        logits = lm(input_ids=ids[:, :-1], use_cache=False).logits
        nn.functional.cross_entropy(logits.reshape(-1, 256), ids[:, 1:].reshape(-1)).backward()
        optimizer.step()
    return step


def _keras_steps(variants: dict[str, str | None], rounds: int) -> dict[str, list[float]]:
    """Seconds per ``fit`` step of the digits net in Keras under each variant's recipe (None: plain)."""
    import keras
    import numpy as np

    from bench.fit_timing import fit_step_times
    from recal_app import digits_model
    from recal_keras import ScheduledModifierManager as KerasManager

    rng = np.random.default_rng(0)
    x, y = rng.random((1024, 8, 8, 1), dtype=np.float32), rng.integers(0, 10, 1024)
    built = {}
    for name, recipe in variants.items():
        model, optimizer, callbacks = digits_model(0), keras.optimizers.AdamW(1e-4), []
        if recipe is not None:
            model, callbacks = KerasManager.from_yaml(recipe).modify(model, optimizer, steps_per_epoch=1024 // 128)
        model.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        built[name] = (model, callbacks)
    return fit_step_times(keras, built, x, y, rounds)


def table(data: dict) -> str:
    """The docs' table of the saved runs (one per CPU)."""
    lines = ["| CPU | model | variant | ms/step | x plain | x observed QAT |", "|---|---|---|---:|---:|---:|"]
    for run in data["runs"]:
        cpu = run["cpu"].split(",")[0].removeprefix("CPU: ")
        for row in run["rows"]:
            vs = "" if row["x_observed"] is None else f"{row['x_observed']:.2f}"
            lines.append(f"| {cpu} | {row['model']} | {row['variant']} | {row['ms']:.1f} | {row['x_plain']:.2f} | "
                         f"{vs} |")
    notes = "; ".join(f"{run['cpu']}: {run['threads']} threads, medians of {run['steps']} interleaved steps"
                      for run in data["runs"])
    return ("\n".join(lines) + f"\n\n{notes} (Keras: its `fit` epochs in turn, each step timed, the first of each "
            "left out). x observed QAT: against the model's first QAT row (minmax). "
            "`python scripts/bench_lsq_overhead.py --json docs/results/lsq_overhead.json`.")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path, help="also keep this CPU's run here")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    models = {
        "small ResNet, W8A8": (_cnn, {"plain": None, "QAT, observed": W8A8["observed"],
                                      "QAT, learned (lsq)": W8A8["learned"]}),
        "decoder, int4 groups of 32": (_decoder, {"plain": None, "QAT, minmax": INT4 % "minmax",
                                                  "QAT, mse": INT4 % "mse", "QAT, learned (lsq)": INT4 % "lsq"}),
    }
    rows = []
    models["Keras (TensorFlow) digits net, W8A8"] = (None, models["small ResNet, W8A8"][1])  # (the same recipes)
    for model, (build, variants) in models.items():
        if build is None:  # Keras: whole fit epochs per variant in turn (8 steps each), steps timed inside them
            ms = medians(_keras_steps(variants, max(args.steps // 7, 3)), scale=1e3)
        else:
            ms = medians(interleaved({name: build(recipe) for name, recipe in variants.items()}, args.steps,
                                     warmup=3), scale=1e3)
        observed = ms[list(variants)[1]]
        print(f"\n{model}: {machine()['cpu']}, {args.threads} threads, median of {args.steps} interleaved steps")
        for name, value in ms.items():
            ratio = None if variants[name] is None else value / observed
            rows.append({"model": model, "variant": name, "ms": value, "x_plain": value / ms["plain"],
                         "x_observed": ratio})
            print(f"  {name:22s} {value:8.2f} ms  x{value / ms['plain']:.2f} plain"
                  + ("" if ratio is None else f"  x{ratio:.2f} observed QAT"), flush=True)
    if args.json:
        save_run(args.json, {**machine(), "threads": args.threads, "steps": args.steps, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
