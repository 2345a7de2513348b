"""What a recipe adds to Keras's train step on JAX, where XLA compiles the step before its first run: per
keras.applications model (random weights, 32x32 inputs, batch 8, 10 classes) and per recipe, the first epoch
(trace, compile, run) and a later epoch, against plain Keras. Each run is a process of its own (``KERAS_BACKEND=jax``
is read at import).

- **plain**: no recipe.
- **prune**: magnitude pruning of every kernel, masks updated twice an epoch.
- **qat**: QAT from epoch 2 of 4 (the QAT layers are in the model from the start, switched on by the step count:
  nothing compiles again when QAT starts).

    python scripts/bench_jax_compile.py [--models MobileNetV2 EfficientNetB0] [--json docs/results/jax_compile.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from bench.results import report

RECIPES = {
    "plain": None,
    "prune": "- !GMPruningModifier {params: __ALL_PRUNABLE__, init_sparsity: 0.1, final_sparsity: 0.5, start_epoch: 0, "
             "end_epoch: 3, update_frequency: 0.5}\n",
    "qat": "- !EpochRangeModifier {start_epoch: 0, end_epoch: 4}\n- !QuantizationModifier {start_epoch: 2}\n",
}
EPOCHS, STEPS, BATCH = 4, 4, 8


def child(model_name: str, recipe_name: str) -> dict:
    """This process's run: seconds of each epoch."""
    import keras
    import numpy as np

    from recal_keras import ScheduledModifierManager

    keras.utils.set_random_seed(0)
    model = getattr(keras.applications, model_name)(input_shape=(32, 32, 3), weights=None, classes=10)
    optimizer = keras.optimizers.SGD(0.01)
    callbacks = []
    if RECIPES[recipe_name]:
        model, callbacks = ScheduledModifierManager.from_yaml(RECIPES[recipe_name]).modify(model, optimizer, STEPS)
    model.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy())
    seconds: list[float] = []

    class Clock(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            self.start = time.perf_counter()

        def on_epoch_end(self, epoch, logs=None):
            seconds.append(time.perf_counter() - self.start)

    rng = np.random.default_rng(0)
    x, y = rng.random((STEPS * BATCH, 32, 32, 3), dtype=np.float32), rng.integers(0, 10, STEPS * BATCH)
    model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, callbacks=callbacks + [Clock()], verbose=0, shuffle=False)
    return {"model": model_name, "recipe": recipe_name, "epochs": seconds, "keras": keras.__version__,
            "jax": __import__("jax").__version__}


def table(data: dict) -> str:
    """The runs as a Markdown table (also what ``scripts/render_docs.py`` writes into the docs)."""
    lines = ["| model | recipe | first epoch: trace, compile, run (s) | x plain | each later epoch (s) |",
             "|---|---|---:|---:|---|"]
    plain = {r["model"]: r["epochs"][0] for r in data["runs"] if r["recipe"] == "plain"}
    for r in data["runs"]:
        lines.append(f"| {r['model']} | {r['recipe']} | {r['epochs'][0]:.1f} | {r['epochs'][0] / plain[r['model']]:.2f} | "
                     f"{', '.join(f'{s:.1f}' for s in r['epochs'][1:])} |")
    first = data["runs"][0]
    return "\n".join(lines) + (f"\n\n{data['cpu']}; Keras {first['keras']}, JAX {first['jax']}, 2 cores; {EPOCHS} "
                               f"epochs of {STEPS} steps, batch {BATCH}, 32x32 (`python scripts/bench_jax_compile.py "
                               "--json docs/results/jax_compile.json`)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["MobileNetV2", "EfficientNetB0"])
    parser.add_argument("--json", type=Path, help="also write the results here (docs/results/jax_compile.json)")
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(*args.child)))
        return 0
    from bench.results import machine

    runs = []
    for model in args.models:
        for recipe in RECIPES:
            env = {**os.environ, "KERAS_BACKEND": "jax", "TF_CPP_MIN_LOG_LEVEL": "3"}
            out = subprocess.run([sys.executable, __file__, "--child", model, recipe], env=env, check=True,
                                 stdout=subprocess.PIPE, text=True).stdout
            runs.append(json.loads(out.strip().splitlines()[-1]))
            print(f"{model} {recipe}: " + ", ".join(f"{s:.1f}s" for s in runs[-1]["epochs"]), flush=True)
    data = {**machine(), "runs": runs}
    return report(data, table(data), args.json)


if __name__ == "__main__":
    sys.exit(main())
