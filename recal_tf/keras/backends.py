"""What recal runs on each Keras 3 backend, checked once at ``modify`` (every problem located in the recipe).

- TensorFlow: everything (pruning, LR, weight decay, trainable flags, QAT with ONNX export).
- PyTorch: pruning, LR, weight decay and trainable flags (eager train steps; ``keras.ops``).
- JAX: pruning, LR and weight decay. A JAX train step hands the optimizer exactly the variables it was built
  with, so a trainable flag cannot change mid-fit with the same optimizer (Keras itself needs a new one).

QAT stays on TensorFlow: its layers use TensorFlow's fake-quantization ops, which Keras's ONNX export writes as
the QuantizeLinear / DequantizeLinear pairs the int8 converter takes.
"""

from __future__ import annotations

import keras

from recal_core.errors import Problem
from recal_core.schedule import RecipeSchedule

BACKENDS = ("tensorflow", "jax", "torch")


def current_backend() -> str:
    """This process's Keras backend; ``RuntimeError`` naming it when recal does not run there."""
    backend = keras.backend.backend()
    if backend not in BACKENDS:
        raise RuntimeError(f"recal_tf.keras runs on Keras's TensorFlow, JAX and PyTorch backends; this process uses "
                           f"{backend!r}: set KERAS_BACKEND to one of them before importing keras")
    return backend


def backend_problems(schedule: RecipeSchedule, backend: str) -> list[Problem]:
    """One located problem per modifier ``backend`` cannot run."""
    recipe, problems = schedule.recipe, []
    if backend != "tensorflow":
        for index, _ in schedule.quantization:
            problems.append(recipe.problem(
                index, None, f"QAT on Keras runs on the TensorFlow backend only; this process uses {backend!r} "
                "(pruning, LR and weight decay run on every backend)",
                expected="KERAS_BACKEND=tensorflow for this recipe, or its QuantizationModifier run with recal_torch"))
    if backend == "jax":
        for index, _, _ in schedule.trainable:
            problems.append(recipe.problem(
                index, None, "trainable flags cannot change mid-fit on Keras's JAX backend (a JAX train step updates "
                "exactly the variables its optimizer was built with)",
                expected="KERAS_BACKEND=tensorflow or torch for this recipe, or no TrainableParamsModifier"))
    return problems
