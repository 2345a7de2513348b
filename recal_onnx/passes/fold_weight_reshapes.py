"""A reshaped constant weight: ``DQ(w_int8) -> Reshape`` becomes ``DQ(reshape(w_int8))`` (axis moved with it).

tf2onnx writes a Keras ``DepthwiseConv2D`` kernel ``[h, w, channels, 1]`` as ``Reshape`` to ``[h, w, 1, channels]``,
then ``Transpose`` to the ``[channels, 1, h, w]`` ONNX's grouped Conv reads. With the reshape folded into the
integers, :mod:`.weight_transpose` folds the transpose and the conv pass makes the depthwise conv a QLinearConv.

Before::  w_int8 [3, 3, C, 1] -> DequantizeLinear(s_w [C], axis=2) -> Reshape([3, 3, 1, C]) -> Transpose -> Conv
After::   w_int8 [3, 3, 1, C] -> DequantizeLinear(s_w [C], axis=3) -> Transpose -> Conv

A per-channel weight is moved only when each element keeps its channel: the channel axis keeps its length and
the count of elements before it (size-1 axes come and go); otherwise the reshape stays, and the op it feeds stays
float (named by the converter).
"""

from __future__ import annotations

import numpy as np

from ..ir_edits import Graph
from ..qdq import replace_moved_weight, weight


def _new_axis(old_shape: tuple[int, ...], axis: int, new_shape: tuple[int, ...]) -> int | None:
    """The axis of ``new_shape`` that holds ``old_shape``'s ``axis`` element for element, else None."""
    size, before = old_shape[axis], int(np.prod(old_shape[:axis], dtype=np.int64))
    for j, n in enumerate(new_shape):
        if n == size and int(np.prod(new_shape[:j], dtype=np.int64)) == before:
            return j
    return None


def fold_weight_reshapes(g: Graph) -> int:
    count = 0
    for node in g.each("Reshape"):
        if node.outputs[0].is_graph_output() or len(node.inputs) < 2 or not g.is_const(node.inputs[1]):
            continue
        w = weight(g, node.inputs[0])
        if w is None:
            continue
        try:
            reshaped = np.reshape(w.q, [int(d) for d in g.const(node.inputs[1])])  # 0 and -1 as numpy reads them
        except ValueError:
            continue
        if 0 in g.const(node.inputs[1]):
            continue  # ONNX's 0 copies the input's length: numpy would read an empty axis
        per_axis = w.scale.size != 1
        if per_axis and w.scale.ndim != 1:
            continue  # blocked quantization: not a layout this pass moves
        axis = _new_axis(w.q.shape, w.axis, reshaped.shape) if per_axis else None
        if per_axis and axis is None:
            continue
        replace_moved_weight(g, node, w, reshaped, axis, "_r")
        count += 1
    return count
