"""A per-channel affine on a quantized activation (tf2onnx's inference BatchNorm) becomes a BatchNormalization.

Before::  DQ(q) -> Mul(a) -> Add(b) [-> Relu] -> QuantizeLinear(s, zp) -> y       (a, b: one value per channel)
After::   q -> Transpose(to NCHW) -> DQ -> BatchNormalization(a, b, mean 0, var 1, epsilon 0) [-> Relu]
            -> QuantizeLinear(s, zp) -> Transpose(back) -> y

Keras's pre-activation BatchNorm (DenseNet's ``BN -> ReLU -> conv``), exported by tf2onnx, is a ``Mul`` and an
``Add`` by per-channel constants on the channels-last tensor, where the conv before it could not fold it.
Written as a BatchNormalization that computes exactly ``x * a + b``, :mod:`.batchnorm_to_conv` makes it a
depthwise 1x1 conv with exact weights, and the conv passes a QLinearConv. ONNX convs are channels-first: on a
channels-last tensor the integers are transposed in and out (the QuantizeLinear the next layer reads moves inside,
the same numbers), so the ReLU and that QuantizeLinear must follow the affine; a channels-first one needs neither.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from ..ir_edits import Graph, Node, Value
from ..qdq import activation

TO_CHANNELS_FIRST, TO_CHANNELS_LAST = [0, 3, 1, 2], [0, 2, 3, 1]


def affine_to_batchnorm(g: Graph) -> int:
    count = 0
    for mul in g.each("Mul"):
        found = _affine(g, mul)
        if found is None:
            continue
        x, a, b, add, axis = found
        if axis == 1:
            _batchnorm(g, x.dq.outputs[0], a, b, mul.name, replaces=add.outputs[0])
            g.remove(mul, add)
            count += 1
            continue
        after = g.only_consumer(add.outputs[0])
        relu = after if after is not None and after.op_type == "Relu" else None
        if relu is not None:
            after = g.only_consumer(relu.outputs[0])
        if after is None or after.op_type != "QuantizeLinear":
            continue
        q = after
        shape = x.dq.outputs[0].shape
        moved = g.add_node("Transpose", [x.q], name=mul.name + "_nchw", perm=TO_CHANNELS_FIRST).outputs[0]
        dq = g.add_node("DequantizeLinear", [moved, x.scale, x.zero_point], name=mul.name + "_dq").outputs[0]
        if shape is not None and len(shape) == 4:
            moved.shape = dq.shape = ir.Shape([shape[i] for i in TO_CHANNELS_FIRST])
        y = _batchnorm(g, dq, a, b, mul.name)
        if relu is not None:
            y = g.add_node("Relu", [y], name=relu.name + "_nchw").outputs[0]
        y = g.add_node("QuantizeLinear", [y, *q.inputs[1:]], name=q.name + "_nchw", **q.attributes).outputs[0]
        g.add_node("Transpose", [y], name=q.name + "_nhwc", perm=TO_CHANNELS_LAST, replaces=q.outputs[0])
        g.remove(*(n for n in (mul, add, relu, q) if n is not None))
        count += 1
    return count


def _affine(g: Graph, mul: Node) -> tuple | None:
    """``(x, a, b, add, channel axis)`` when ``mul`` scales a quantized rank-4 activation per channel by a
    constant and its only reader adds a per-channel constant, else None."""
    for i in (0, 1):
        x, factor = activation(g, mul.inputs[i]), mul.inputs[1 - i]
        if x is not None and g.is_const(factor):
            break
    else:
        return None
    add = g.only_consumer(mul.outputs[0])
    if add is None or add.op_type != "Add" or g.rank(mul.inputs[0]) != 4:
        return None
    shift = add.inputs[1] if add.inputs[0] is mul.outputs[0] else add.inputs[0]
    if not g.is_const(shift):
        return None
    a, b = g.const(factor), g.const(shift)
    axis = _channel_axis(a, b)
    if axis is None:
        return None
    channels = max(a.size, b.size)
    return (x, np.broadcast_to(a.reshape(-1), channels).astype(np.float32),
            np.broadcast_to(b.reshape(-1), channels).astype(np.float32), add, axis)


def _channel_axis(a: np.ndarray, b: np.ndarray) -> int | None:
    """3 when both constants vary along the last axis only ([C] or [1, 1, 1, C]), 1 for [C, 1, 1] or [1, C, 1, 1];
    None otherwise (a scalar is no per-channel affine worth a conv)."""
    axes = set()
    for c in (a, b):
        shape = (1,) * (4 - c.ndim) + c.shape if c.ndim <= 4 else None
        if shape is None:
            return None
        varying = [i for i, n in enumerate(shape) if n > 1]
        if len(varying) > 1:
            return None
        axes.update(varying)
    if len(axes) != 1 or not {1, 3} >= axes:
        return None
    (axis,) = axes
    sizes = {c.size for c in (a, b) if c.size > 1}
    return axis if len(sizes) == 1 else None


def _batchnorm(g: Graph, x: Value, a: np.ndarray, b: np.ndarray, base: str, replaces: Value | None = None) -> Value:
    """``x * a + b`` per channel (axis 1) as a BatchNormalization: mean 0, variance 1, epsilon 0."""
    channels = a.size
    params = [g.add_const(base + "_scale", a), g.add_const(base + "_shift", b),
              g.add_const(base + "_mean", np.zeros(channels, np.float32)),
              g.add_const(base + "_var", np.ones(channels, np.float32))]
    return g.add_node("BatchNormalization", [x, *params], name=base + "_bn", epsilon=0.0,
                      replaces=replaces).outputs[0]
