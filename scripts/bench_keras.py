"""Keras 3: recal's per-step cost inside ``model.fit``, and digits accuracy next to PyTorch.

Part 1 times a CNN (batch 128, 28x28) under plain ``fit`` and under recal (GMP between mask updates,
GMP with every step an update, and LR + GMP), the variants interleaved round by round, medians of the
per-step times Keras reports between batches. With ``--peer`` the same CNN and timing under TF Model
Optimization 0.8.1 on tf-keras 2.21 (``scripts/bench/peer_tfmot.py``) joins the table: it runs in its own
environment, ``.venv-tfmot``, which the script creates on first use (tf-keras pulls the full ``tensorflow``
wheel, about 2.3 GB, and tfmot switches a process to legacy Keras), never in ``.venv``. Part 2 trains the digits
net with ``recal train`` in Keras, the TF graph API and PyTorch, dense, pruned to 90%, pruned to 90% + QAT
converted to int8, and the demo's recipe (``prune_quant.yaml``: pruned to 85% + QAT, int8), over several seeds.

    python scripts/bench_keras.py [--rounds 5] [--steps 40] [--seeds 3] [--peer] [--jit] [--skip-accuracy]
                                  [--skip-overhead] [--frameworks keras tf torch]

``--jit`` compiles every variant with ``jit_compile=True`` (XLA), plain jit ``fit`` being the base.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras
import numpy as np

from recal_keras import ScheduledModifierManager

from bench.fit_timing import fit_step_times

ROOT = Path(__file__).resolve().parent.parent
PEER_ENV = ROOT / ".venv-tfmot"
PEER_PACKAGES = ["tensorflow==2.21.*", "tf-keras==2.21.*", "tensorflow-model-optimization==0.8.1"]
BETWEEN = """
- !GradualKSModifier {params: __ALL_PRUNABLE__, init_sparsity: 0.5, final_sparsity: 0.9, start_epoch: 0.0,
                      end_epoch: 90.0, update_frequency: 10.0}
"""
EVERY_STEP = BETWEEN.replace("update_frequency: 10.0", "update_frequency: -1")
WITH_LR = BETWEEN + """
- !LearningRateModifier {lr_class: CosineAnnealingWarmRestarts, lr_kwargs: {lr_min: 0.0001, cycle_epochs: 10.0},
                         init_lr: 0.001, start_epoch: 0.0, end_epoch: 100.0}
"""


def _cnn(seed: int = 0) -> keras.Model:
    keras.utils.set_random_seed(seed)
    return keras.Sequential([
        keras.Input((28, 28, 1)),
        keras.layers.Conv2D(32, 3, padding="same", activation="relu", name="conv0"),
        keras.layers.Conv2D(64, 3, strides=2, padding="same", activation="relu", name="conv1"),
        keras.layers.Conv2D(64, 3, strides=2, padding="same", activation="relu", name="conv2"),
        keras.layers.Flatten(),
        keras.layers.Dense(128, activation="relu", name="fc0"),
        keras.layers.Dense(10, name="fc1"),
    ])


def _variant(recipe: str | None, steps: int, jit: bool = False):
    model = _cnn()
    optimizer = keras.optimizers.Adam(1e-3)
    callbacks = []
    if recipe:
        model, callbacks = ScheduledModifierManager.from_yaml(recipe).modify(model, optimizer, steps_per_epoch=steps)
    model.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  jit_compile=jit)
    return model, callbacks


def peer_times(rounds: int, steps: int) -> tuple[str, dict[str, list[float]]]:
    """tfmot's per-step times from ``scripts/bench/peer_tfmot.py`` in ``.venv-tfmot`` (created when missing)."""
    python = PEER_ENV / "bin" / "python"
    if not python.exists():
        print(f"creating {PEER_ENV} for the tfmot peer ({', '.join(PEER_PACKAGES)})", file=sys.stderr)
        subprocess.run([sys.executable, "-m", "venv", str(PEER_ENV)], check=True)
        subprocess.run([str(python), "-m", "pip", "install", "-q", *PEER_PACKAGES], check=True)
    out = subprocess.run([str(python), str(ROOT / "scripts" / "bench" / "peer_tfmot.py"), "--rounds", str(rounds),
                          "--steps", str(steps)], check=True, capture_output=True, text=True).stdout
    result = json.loads(out.strip().splitlines()[-1])
    v = result["versions"]
    return f"tfmot {v['tfmot']} on tf-keras {v['tf_keras']}", result["times"]


def overhead(rounds: int, steps: int, peer: bool, jit: bool = False) -> None:
    rng = np.random.default_rng(0)
    x = rng.random((steps * 128, 28, 28, 1), dtype=np.float32)
    y = rng.integers(0, 10, steps * 128)
    variants = {"plain fit": None, "recal GMP, between updates": BETWEEN, "recal GMP, update every step": EVERY_STEP,
                "recal GMP + cosine LR": WITH_LR}
    built = {name: _variant(recipe, steps, jit) for name, recipe in variants.items()}
    times = fit_step_times(keras, built, x, y, rounds)
    tables = {f"recal on Keras {keras.__version__}" + (", jit_compile" if jit else ""): times}
    if peer:
        label, peer_result = peer_times(rounds, steps)
        tables[label] = peer_result
    print(f"\nCNN (3 conv, 2 dense), batch 128, Adam; {rounds} interleaved rounds of {steps} steps, median per step "
          "(each framework against its own plain fit; the peer runs after recal, in its own process)")
    print("| framework | variant | ms / step | vs plain fit |")
    print("| --- | --- | ---: | ---: |")
    for framework, result in tables.items():
        base = statistics.median(result["plain fit"])
        for name, values in result.items():
            m = statistics.median(values)
            print(f"| {framework} | {name} | {1000 * m:.2f} | {100 * (m / base - 1):+.1f}% |")


def accuracy(seeds: int, frameworks: tuple[str, ...] = ("keras", "tf", "torch")) -> None:
    from recal_core import load_recipe
    from recal_app import train

    recipes = {"dense": ROOT / "recal_core/recipes/dense.yaml", "pruned 90%": ROOT / "recal_core/recipes/prune90.yaml",
               "pruned 90% + QAT, int8": ROOT / "recal_core/recipes/prune90_quant.yaml",
               "the demo's, pruned 85% + QAT, int8": ROOT / "recal_core/recipes/prune_quant.yaml"}
    results: dict[tuple[str, str], list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for seed in range(seeds):
            for framework in frameworks:
                for label, path in recipes.items():
                    out = Path(tmp) / f"{framework}-{label}-{seed}".replace(" ", "_").replace("%", "")
                    run = train(load_recipe(path), framework, out, seed=seed, progress=False)
                    onnx = run.artefacts[-1]  # the int8 model after QAT, else the ONNX export
                    results.setdefault((framework, label), []).append(onnx.accuracy)
    print(f"\ndigits test accuracy of the ONNX model (recal train, {seeds} seeds: mean, min-max)")
    print("| framework | " + " | ".join(recipes) + " |")
    print("| --- | " + " | ".join("---:" for _ in recipes) + " |")
    for framework in frameworks:
        cells = []
        for label in recipes:
            values = results[(framework, label)]
            cells.append(f"{100 * statistics.fmean(values):.2f} ({100 * min(values):.2f}-{100 * max(values):.2f})")
        print(f"| {framework} | " + " | ".join(cells) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--peer", action="store_true", help="add tfmot 0.8.1 on tf-keras (creates .venv-tfmot)")
    parser.add_argument("--skip-accuracy", action="store_true")
    parser.add_argument("--jit", action="store_true", help="compile every variant with jit_compile=True (XLA)")
    parser.add_argument("--skip-overhead", action="store_true")
    parser.add_argument("--frameworks", nargs="+", default=["keras", "tf", "torch"], choices=["keras", "tf", "torch"],
                        help="the accuracy part's front ends")
    args = parser.parse_args()
    if not args.skip_overhead:
        overhead(args.rounds, args.steps, args.peer, args.jit)
    if not args.skip_accuracy:
        accuracy(args.seeds, tuple(args.frameworks))


if __name__ == "__main__":
    main()
