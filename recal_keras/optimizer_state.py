"""What recal reads and writes on a Keras optimizer: its float LR, the weight decay in force, per-weight state.

The recipe's weight decay reaches the optimizer two ways, one per kind of train step:

- TensorFlow: a per-step table Keras reads with ``tf.cast`` in the graph (:class:`WeightDecayTable`), so nothing
  new is saved with the optimizer;
- JAX and PyTorch: one optimizer variable recal's step sets, like the LR (a JAX train step only carries the
  optimizer's and the model's variables from step to step).

Either way ``float(optimizer.weight_decay)`` and ``get_config()`` give the decay in force for the next step.
"""

from __future__ import annotations

import keras
import numpy as np


class WeightDecayTable:
    """The optimizer's ``weight_decay`` as a per-step table. Keras reads it with ``tf.cast`` inside the train step,
    which calls ``__tf_tensor__`` (the value at ``optimizer.iterations``, in the graph); Python reads (``float``,
    ``print``, the optimizer's ``get_config``) see the value in force for the next step."""

    def __init__(self, values, iterations):
        self.values = np.asarray(values, np.float32)
        self.iterations = iterations

    def __tf_tensor__(self, dtype=None, name=None):
        import tensorflow as tf

        k = tf.minimum(tf.cast(self.iterations, tf.int64), len(self.values) - 1)
        value = tf.gather(tf.constant(self.values), k)
        return tf.cast(value, dtype) if dtype is not None else value

    def __float__(self) -> float:
        return float(self.values[min(int(self.iterations.numpy()), len(self.values) - 1)])

    def __eq__(self, other):
        return float(self) == other

    __hash__ = None

    def __repr__(self) -> str:
        return repr(float(self))

    def __format__(self, spec: str) -> str:
        return format(float(self), spec)


def install_weight_decay(optimizer, values: np.ndarray, as_table: bool):
    """Make ``optimizer.weight_decay`` the recipe's (``values[k]`` at step ``k``); returns the variable recal's step
    sets, or None for a table (which needs no step)."""
    if as_table:
        optimizer.weight_decay = WeightDecayTable(values, optimizer.iterations)
        variable = None
    else:
        variable = add_recal_variable(optimizer, (), float(values[0]), "float32", "recal_weight_decay")
        optimizer.weight_decay = variable
    get_config = optimizer.get_config

    def config():  # the decay in force now, as a float (JSON, .keras files)
        values = get_config()
        values["weight_decay"] = float(values["weight_decay"])
        return values

    optimizer.get_config = config
    return variable


def float_lr(optimizer) -> float | None:
    """The optimizer's LR as a float; None for a schedule."""
    lr = optimizer._learning_rate
    if isinstance(lr, keras.optimizers.schedules.LearningRateSchedule) or callable(lr) and not hasattr(lr, "numpy"):
        return None
    return float(lr.numpy() if hasattr(lr, "numpy") else lr)


def slots_of(optimizer, variable: keras.Variable) -> list[keras.Variable]:
    """The optimizer's per-weight state of ``variable`` (momentum, Adam's moments, ...): Keras optimizers keep
    each kind in a list indexed like their trainable variables."""
    index = optimizer._get_variable_index(variable)
    count = len(optimizer._trainable_variables)
    slots = []
    for value in vars(optimizer).values():
        if isinstance(value, (list, tuple)) and len(value) == count and value is not optimizer._trainable_variables:
            slot = value[index]
            if isinstance(slot, keras.Variable) and tuple(slot.shape) == tuple(variable.shape):
                slots.append(slot)
    return slots


def add_recal_variable(optimizer, shape, initial, dtype: str, name: str) -> keras.Variable:
    """One of recal's own variables (a mask, an update id, the weight decay in force) as an optimizer variable: a JAX
    train step carries only the optimizer's and the model's variables from step to step. They stay out of what the
    optimizer saves (``.keras`` files, ``BackupAndRestore``), so a saved optimizer loads into a new one with or
    without recal, as on TensorFlow (recal's step state is rebuilt from ``optimizer.iterations`` at every start)."""
    variable = optimizer.add_variable(tuple(shape), initializer=keras.initializers.Constant(initial), dtype=dtype,
                                      name=name)
    held = getattr(optimizer, "_recal_variables", None)
    if held is None:
        optimizer._recal_variables = set()
        held = optimizer._recal_variables  # Keras tracks what is set on an optimizer: a copy of the set
        _without_recal_variables(optimizer, "save_own_variables")
        _without_recal_variables(optimizer, "load_own_variables")
    held.add(id(variable))
    return variable


def _without_recal_variables(optimizer, method: str) -> None:
    inner = getattr(optimizer, method)

    def call(store):
        everything = optimizer._variables
        optimizer._variables = [v for v in everything if id(v) not in optimizer._recal_variables]
        try:
            return inner(store)
        finally:
            optimizer._variables = everything

    setattr(optimizer, method, call)
