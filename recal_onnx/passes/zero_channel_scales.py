"""A weight channel that is all zeros (a filter pruned whole: its integers all its zero point) gets the scale that
holds its layer's bias best.

Its weights stay 0 whatever the scale, so the scale only sets the grid of that channel's int32 bias,
``round(bias / (s_x * s_w))``, which is then all that channel outputs. QAT exporters floor such a scale at a
tiny value (max|w| = 0), or write 1: the first overflows int32, the second rounds the bias to steps of ``s_x``
(several output steps where ``s_x`` is larger than the output's). Any grid rounds it somewhat, and on a net
whose channels feed each other one flipped output step travels. So a zero channel of a Conv / Gemm whose bias
and input scale are constants gets ``s_w = |bias| / (s_x * 2**30)``: the bias becomes +-2**30 in int32, exact
to a part in 2**30, far from overflow. A zero channel without a bias (or a layer this cannot read) gets the
largest scale of the layer's other channels where its own is tiny.

Before::  DequantizeLinear(w_int8, [s_0, 1e-11, s_2, ...], axis=0) -> Conv(x, ., bias=[b_0, b_1, b_2, ...])
After::   DequantizeLinear(w_int8, [s_0, |b_1| / (s_x * 2**30), s_2, ...], axis=0)   (channel 1 all zeros)
"""

from __future__ import annotations

import numpy as np

from ..ir_edits import Graph, Value, attr, input_of
from ..qdq import QWeight, activation, scalar, weight

SCALE_FLOOR = 1e-6  # below it, a zero channel without a readable bias takes its neighbours' scale
BIAS_STEPS = 2.0 ** 30  # what a zero channel's bias becomes in int32


def zero_channel_scales(g: Graph) -> int:
    count = 0
    for node in g.each("DequantizeLinear"):
        w = weight(g, node.outputs[0])
        if w is None or w.scale.size < 2 or w.scale.size != w.q.shape[w.axis]:
            continue
        zero_points = np.broadcast_to(w.zero_point.reshape(-1), (w.scale.size,)).astype(np.int16)
        zero = ~np.any(np.moveaxis(w.q, w.axis, 0).reshape(w.scale.size, -1).astype(np.int16)
                       != zero_points[:, None], axis=1)  # every integer its zero point: the channel is 0
        if not zero.any():
            continue
        old = w.scale.reshape(-1)
        others = old[~zero]
        stand_in = float(others.max()) if others.size and others.max() >= SCALE_FLOOR else 1.0
        scale = np.where(zero & (old < SCALE_FLOOR), stand_in, old).astype(np.float64)
        bias_and_x = _bias_and_input_scale(g, node.outputs[0], w)
        if bias_and_x is not None:
            bias, x_scale = bias_and_x
            exact = zero & (bias != 0)
            scale[exact] = np.abs(bias[exact]) / (x_scale * BIAS_STEPS)
        scale = scale.astype(w.scale.dtype)
        if np.array_equal(scale, old):
            continue
        node.replace_input_with(1, g.add_const(node.inputs[1].name + "_zero_channels", scale.reshape(w.scale.shape)))
        count += 1
    return count


def _bias_and_input_scale(g: Graph, value: Value, w: QWeight) -> tuple[np.ndarray, float] | None:
    """The constant bias (one per weight channel) and input scale of the one Conv / Gemm that reads ``value``
    as its weight, else None."""
    layer = g.only_consumer(value)
    if layer is None or input_of(layer, 2) is None or layer.inputs[1] is not value:
        return None
    if layer.op_type == "Gemm":
        out_axis = 0 if attr(layer, "transB", 0) else 1
        if out_axis != w.axis or attr(layer, "alpha", 1.0) != 1.0 or attr(layer, "beta", 1.0) != 1.0:
            return None
    elif layer.op_type != "Conv" or w.axis != 0:
        return None
    bias = g.const(layer.inputs[2])
    x = activation(g, layer.inputs[0])
    if bias is None or x is None or bias.size != w.scale.size:
        return None
    return np.asarray(bias, np.float64).reshape(-1), scalar(g, x.scale)
