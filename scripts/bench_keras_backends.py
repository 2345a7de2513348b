"""Keras 3 on each backend: recal's per-step cost inside ``model.fit`` on TensorFlow, JAX and PyTorch.

The CNN and recipes of ``scripts/bench_keras.py`` (batch 128, 28x28, Adam): plain ``fit``, recal GMP between mask
updates, GMP with every step an update, and GMP + cosine LR. Each backend runs in its own process
(``KERAS_BACKEND`` is read once, at import); within it the variants are interleaved round by round, each first in
turn. A step's time
is the wall time from the end of an epoch's first step to the end of the epoch, over the steps between (JAX
dispatches asynchronously, so a single step's callbacks would time its dispatch; the epoch ends once every step
has run), median over rounds: the cost inside the train step, without ``fit``'s start and recal's once-an-epoch
work. The sparsity column is the share of pruned kernels' weights at zero
after the run, the recipe's effect beside its cost (the three backends' masks are equal step for step on the
same weights: ``tests/keras/test_keras_backends.py``).

    python scripts/bench_keras_backends.py [--rounds 5] [--steps 20] [--json docs/results/keras_backends.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench.results import save

ROOT = Path(__file__).resolve().parent.parent
BACKENDS = ("tensorflow", "jax", "torch")


def child(rounds: int, steps: int) -> dict:
    """This process's backend: per variant, the seconds per step of each round and the sparsity at the end."""
    import keras
    import numpy as np

    from bench_keras import BETWEEN, EVERY_STEP, WITH_LR, _cnn
    from recal_keras import ScheduledModifierManager

    class Clock(keras.callbacks.Callback):
        """When an epoch's first step ended, and when the epoch did (after JAX's state sync: every step has run)."""

        def on_train_batch_end(self, batch, logs=None):
            if batch == 0:
                self.first = time.perf_counter()

        def on_epoch_end(self, epoch, logs=None):
            self.end = time.perf_counter()

    rng = np.random.default_rng(0)
    x = rng.random((steps * 128, 28, 28, 1), dtype=np.float32)
    y = rng.integers(0, 10, steps * 128)
    variants = {"plain fit": None, "recal GMP, between updates": BETWEEN, "recal GMP, update every step": EVERY_STEP,
                "recal GMP + cosine LR": WITH_LR}
    built = {}
    for name, recipe in variants.items():
        model, optimizer, callbacks, manager = _cnn(), keras.optimizers.Adam(1e-3), [], None
        if recipe:
            manager = ScheduledModifierManager.from_yaml(recipe)
            model, callbacks = manager.modify(model, optimizer, steps_per_epoch=steps)
        model.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        model.fit(x, y, batch_size=128, epochs=1, callbacks=callbacks, verbose=0)  # trace, compile, warm up
        built[name] = (model, callbacks, manager)
    times: dict[str, list[float]] = {name: [] for name in variants}
    names = list(built)
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:  # each variant first in turn
            model, callbacks, _ = built[name]
            clock = Clock()
            model.fit(x, y, batch_size=128, epochs=r + 2, initial_epoch=r + 1, callbacks=callbacks + [clock],
                      verbose=0)
            times[name].append((clock.end - clock.first) / (steps - 1))
    sparsity = {}
    for name, (model, _, manager) in built.items():
        if manager is not None:
            zeros = manager.finalize(model)
            sparsity[name] = statistics.fmean(zeros.values())
    return {"backend": keras.backend.backend(), "keras": keras.__version__, "times": times, "sparsity": sparsity,
            "backend_version": _version(keras.backend.backend())}


def _version(backend: str) -> str:
    import importlib

    return importlib.import_module(backend).__version__


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--json", type=Path, help="also write the results here (docs/results/keras_backends.json)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.rounds, args.steps)))
        return
    results = []
    for backend in BACKENDS:
        env = {**os.environ, "KERAS_BACKEND": backend, "TF_CPP_MIN_LOG_LEVEL": "3"}
        out = subprocess.run([sys.executable, __file__, "--child", "--rounds", str(args.rounds), "--steps",
                              str(args.steps)], env=env, check=True, capture_output=True, text=True, cwd=ROOT).stdout
        results.append(json.loads(out.strip().splitlines()[-1]))
    data = {"rounds": args.rounds, "steps": args.steps, "backends": results}
    print(table(data))
    if args.json:
        save(args.json, data)


def table(data: dict) -> str:
    """The results as a Markdown table (also what ``scripts/render_docs.py`` writes into the docs)."""
    lines = ["| backend | variant | ms / step | vs plain fit | sparsity at the end |", "|---|---|---:|---:|---:|"]
    for result in data["backends"]:
        base = statistics.median(result["times"]["plain fit"])
        for name, values in result["times"].items():
            m = statistics.median(values)
            sparsity = result["sparsity"].get(name)
            lines.append(f"| {result['backend']} {result['backend_version']} | {name} | {1000 * m:.1f} | "
                         f"{100 * (m / base - 1):+.1f}% | {'-' if sparsity is None else f'{100 * sparsity:.1f}%'} |")
    keras_version = data["backends"][0]["keras"]
    return "\n".join(lines) + (f"\n\nKeras {keras_version}; CNN (3 conv, 2 dense), batch 128, Adam; {data['rounds']} "
                               f"interleaved rounds of {data['steps']} steps per backend, median time per step after an epoch's "
                               "first, 2 cores (`python scripts/bench_keras_backends.py --json "
                               "docs/results/keras_backends.json`)")


if __name__ == "__main__":
    main()
