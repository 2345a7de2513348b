"""The peer row of ``bench_keras.py``: TF Model Optimization 0.8.1 pruning on tf-keras (Keras 2), timed as recal is.

Runs only in the separate environment ``bench_keras.py --peer`` creates (tf-keras pulls the full ``tensorflow``
wheel and importing tfmot switches the process to legacy Keras). Prints one JSON object:
``{"versions": ..., "ms_per_step": {variant: [per-step seconds, ...]}}``.

    .venv-tfmot/bin/python scripts/bench/peer_tfmot.py --rounds 5 --steps 40
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

os.environ["TF_USE_LEGACY_KERAS"] = "1"
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np
import tensorflow as tf
import tensorflow_model_optimization as tfmot
import tf_keras as keras

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/: the harness, nothing of recal
from bench.fit_timing import fit_step_times


def _cnn() -> keras.Model:
    """bench_keras.py's CNN, layer for layer."""
    keras.utils.set_random_seed(0)
    return keras.Sequential([
        keras.layers.InputLayer((28, 28, 1)),
        keras.layers.Conv2D(32, 3, padding="same", activation="relu"),
        keras.layers.Conv2D(64, 3, strides=2, padding="same", activation="relu"),
        keras.layers.Conv2D(64, 3, strides=2, padding="same", activation="relu"),
        keras.layers.Flatten(),
        keras.layers.Dense(128, activation="relu"),
        keras.layers.Dense(10),
    ])


def _variant(frequency: int | None, steps: int):
    model, callbacks = _cnn(), []
    if frequency is not None:  # GMP 50% -> 90% over 90 epochs, as bench_keras.py's recipes
        schedule = tfmot.sparsity.keras.PolynomialDecay(0.5, 0.9, begin_step=0, end_step=90 * steps,
                                                        frequency=frequency)
        model = tfmot.sparsity.keras.prune_low_magnitude(model, pruning_schedule=schedule)
        callbacks = [tfmot.sparsity.keras.UpdatePruningStep()]
    model.compile(optimizer=keras.optimizers.Adam(1e-3),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model, callbacks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    x = rng.random((args.steps * 128, 28, 28, 1), dtype=np.float32)
    y = rng.integers(0, 10, args.steps * 128)
    variants = {"plain fit": None, "tfmot GMP, between updates": 10 * args.steps, "tfmot GMP, update every step": 1}
    built = {name: _variant(frequency, args.steps) for name, frequency in variants.items()}
    times = fit_step_times(keras, built, x, y, args.rounds)
    pruned = built["tfmot GMP, update every step"][0]
    zeros = [float((w.numpy() == 0).mean()) for w in pruned.weights if "kernel" in w.name and "mask" not in w.name]
    print(json.dumps({"versions": {"tensorflow": tf.__version__, "tf_keras": keras.__version__,
                                   "tfmot": tfmot.__version__}, "kernel_sparsity": zeros, "times": times}))


if __name__ == "__main__":
    main()
