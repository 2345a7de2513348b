"""What recal runs on each Keras 3 backend, checked once at ``modify`` (every problem located in the recipe).

- TensorFlow: everything (pruning, LR, weight decay, trainable flags, QAT with ONNX export).
- PyTorch: the same (eager train steps; ``keras.ops``, and ``torch.fake_quantize_*`` in a finalized QAT model,
  which torch.onnx writes as QuantizeLinear / DequantizeLinear).
- JAX: pruning, LR, weight decay and QAT (a QDQ primitive jax2onnx writes as QuantizeLinear / DequantizeLinear:
  :mod:`recal_keras.jax_qdq`). A JAX train step hands the optimizer exactly the variables it was built with, so a
  trainable flag cannot change mid-fit with the same optimizer (Keras itself needs a new one).
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
        raise RuntimeError(f"recal_keras runs on Keras's TensorFlow, JAX and PyTorch backends; this process uses "
                           f"{backend!r}: set KERAS_BACKEND to one of them before importing keras")
    return backend


def backend_problems(schedule: RecipeSchedule, backend: str) -> list[Problem]:
    """One located problem per modifier ``backend`` cannot run."""
    recipe, problems = schedule.recipe, []
    if backend == "jax":
        for index, _, _ in schedule.trainable:
            problems.append(recipe.problem(
                index, None, "trainable flags cannot change mid-fit on Keras's JAX backend (a JAX train step updates "
                "exactly the variables its optimizer was built with)",
                expected="KERAS_BACKEND=tensorflow or torch for this recipe, or no TrainableParamsModifier"))
    return problems


def check_strategy(model: keras.Model) -> None:
    """On TensorFlow under ``tf.distribute``: the model, its optimizer and ``modify`` are all in the strategy's scope
    (recal's variables are created there too); a ``ValueError`` saying which is not otherwise."""
    import tensorflow as tf

    strategy = tf.distribute.get_strategy()
    variable = model.weights[0].value
    if not tf.distribute.has_strategy() and getattr(variable, "_distribute_strategy", None) is not None:
        raise ValueError(f"model {model.name!r} was built inside a tf.distribute strategy's scope, but modify() "
                         "was called outside it: call modify() inside `with strategy.scope():` too")
    if tf.distribute.has_strategy() and not strategy.extended.variable_created_in_scope(variable):
        raise ValueError(f"model {model.name!r} was built outside the current tf.distribute strategy's scope: "
                         "build the model, its optimizer and call modify() all inside `with strategy.scope():`")
