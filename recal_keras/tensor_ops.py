"""The few tensor ops recal's in-graph pruning math (:mod:`recal_keras.mask_ops`) and learned quantization scales
(:mod:`recal_keras.lsq`) need, per framework.

The masks are computed by one piece of code in every front end; it calls these adapters, so the ``tf.compat.v1``
graph API and Keras on TensorFlow run TensorFlow ops (``tf.argsort(stable=True)``, explicit control dependencies
for graph mode), while Keras on JAX or PyTorch runs ``keras.ops`` on the backend's own tensors.
"""

from __future__ import annotations

import numpy as np


class TensorFlowOps:
    """TensorFlow: graph mode (the seed's ``tf.compat.v1`` API), ``tf.function`` and XLA alike."""

    index_dtype = "int64"
    assigns_in_branches = True  # a mask is written only at its update points

    def __init__(self):
        import tensorflow as tf

        self.tf = tf
        for name in ("where", "maximum", "minimum", "cast", "reshape", "transpose", "abs", "square", "sqrt",
                     "broadcast_to", "cond", "not_equal", "logical_and", "zeros_like", "ones_like", "stop_gradient",
                     "round", "exp"):
            setattr(self, name, getattr(tf, name))
        self.clip = tf.clip_by_value

    def constant(self, value, dtype=None):
        return self.tf.constant(value, dtype)

    def take(self, table, index):
        return self.tf.gather(table, index)

    def pick(self, pred, a, b):
        """``a`` where the scalar ``pred`` holds, else ``b`` (a select in the graph)."""
        return self.tf.where(pred, a, b)

    def one(self, dtype):
        return self.tf.constant(1, dtype)

    def sum(self, x, axis):
        return self.tf.reduce_sum(x, axis=axis)

    def mean(self, x, axis):
        return self.tf.reduce_mean(x, axis=axis)

    def max(self, x, axis):
        return self.tf.reduce_max(x, axis=axis)

    def concatenate(self, parts):
        return self.tf.concat(parts, 0)

    def argsort(self, x, axis=-1):
        """Stable: equal magnitudes are ranked by position, as recal_torch ranks them."""
        return self.tf.argsort(x, axis=axis, stable=True)

    def dtype_of(self, x) -> str:
        return x.dtype.base_dtype.name

    def read(self, variable):
        return variable.read_value()

    def assign(self, variable, value):
        return variable.assign(value, read_value=False)

    def after(self, ops: list, values: list) -> list:
        """``values`` read after ``ops`` ran (graph mode runs only what a fetched tensor depends on)."""
        with self.tf.control_dependencies(ops):
            return [self.tf.identity(v) for v in values]


class KerasOps:
    """``keras.ops`` on Keras's JAX or PyTorch backend, inside a traced or eager train step (program order holds)."""

    index_dtype = "int32"  # JAX computes in 32 bits unless x64 is on; step counts and update ids fit
    assigns_in_branches = False  # JAX's lax.cond branches are pure: the masks are stored after it

    def __init__(self):
        import keras
        from keras import ops

        self.ops = ops
        self.eager = keras.backend.backend() == "torch"  # PyTorch's train step runs op by op: branches are Python
        self._ones: dict[str, object] = {}
        self._tables: dict[tuple[int, str | None], tuple[object, object]] = {}
        for name in ("where", "maximum", "minimum", "cast", "reshape", "transpose", "abs", "square", "sqrt",
                     "broadcast_to", "cond", "not_equal", "logical_and", "zeros_like", "ones_like", "take",
                     "argsort", "stop_gradient", "round", "exp", "clip"):  # (argsort: stable on JAX and PyTorch)
            setattr(self, name, getattr(ops, name))

    def constant(self, value, dtype=None):
        """``value`` as a tensor; a table (a NumPy array or list recal keeps) converted once, not at every step."""
        key = (id(value), dtype)
        held = self._tables.get(key)
        if held is not None and held[0] is value:
            return held[1]
        array = np.asarray(value)
        if array.dtype == np.int64 or dtype == "int64":
            array, dtype = array.astype(np.int32), "int32"
        tensor = self.ops.convert_to_tensor(array, dtype)
        if self.eager and isinstance(value, (np.ndarray, list)):  # under JAX's jit a trace holds its constants
            self._tables[key] = (value, tensor)
        return tensor

    def pick(self, pred, a, b):
        """``a`` where the scalar ``pred`` holds, else ``b``: a Python branch on PyTorch, a select under JAX's jit
        and under torch.jit's trace (an ONNX export, where a branch would be baked in with a warning)."""
        if self.eager and not _torch_tracing():
            return a if bool(pred) else b
        return self.ops.where(pred, a, b)

    def one(self, dtype):
        if dtype not in self._ones:
            self._ones[dtype] = self.ops.convert_to_tensor(np.ones((), dtype), dtype)
        return self._ones[dtype]

    def sum(self, x, axis):
        return self.ops.sum(x, axis=axis)

    def mean(self, x, axis):
        return self.ops.mean(x, axis=axis)

    def max(self, x, axis):
        return self.ops.max(x, axis=axis)

    def concatenate(self, parts):
        return self.ops.concatenate(parts, axis=0)

    def dtype_of(self, x) -> str:
        from keras import backend

        return backend.standardize_dtype(x.dtype)

    def read(self, variable):
        return variable.value

    def assign(self, variable, value):
        variable.assign(value)


def _torch_tracing() -> bool:
    """Whether torch.jit is tracing (Keras's ONNX export on the PyTorch backend); False without torch loaded."""
    import sys

    torch = sys.modules.get("torch")
    return bool(torch is not None and torch.jit.is_tracing())

