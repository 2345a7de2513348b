"""A BatchNorm on a quantized activation becomes a depthwise 1x1 conv, so the integer passes take it.

Before::  q -> DequantizeLinear -> BatchNormalization(gamma, beta, mean, var) -> y
After::   q -> DequantizeLinear -> Conv(DQ(w_int8, s_w, axis=0), bias, group=C, 1x1) -> y

A pre-activation BatchNorm (DenseNet's ``BN -> ReLU -> conv`` on concatenated features, ResNet v2) has no conv
before it to fold into. Its per-channel factor ``a = gamma / sqrt(var + eps)`` is held exactly as an int8 weight
of +-64 with scale ``|a| / 64`` (64: int8 and exact on every CPU, as 7-bit QAT weights are), and its shift
``beta - a * mean`` as the bias, which the conv pass puts on its int32 grid (off by at most half a step of
``s_x * s_w``, a 128th of an input step or less). The ReLU after it, and the QuantizeLinear the next conv reads,
then make it a QLinearConv like any other.
"""

from __future__ import annotations

import numpy as np

from recal_core.modifiers import REDUCED_WEIGHT_LEVELS

from ..graph import Graph, attr, input_of
from ..qdq import activation

LEVEL = REDUCED_WEIGHT_LEVELS  # the int8 weight every channel's factor is written as (its sign, times 64)


def batchnorm_to_conv(g: Graph) -> int:
    count = 0
    for node in g.each("BatchNormalization"):
        x = activation(g, node.inputs[0])
        params = [input_of(node, i) for i in range(1, 5)]
        if x is None or len(node.outputs) != 1 or not all(g.is_const(p) for p in params):
            continue
        gamma, beta, mean, var = (g.const(p).astype(np.float64) for p in params)
        channels = gamma.size
        a = gamma / np.sqrt(var + attr(node, "epsilon", 1e-5))
        if not np.all(np.isfinite(a)) or gamma.ndim != 1:
            continue
        rank = _rank(g, node)
        if rank is None or rank < 3:
            continue
        spatial = [1] * (rank - 2)
        q = np.where(a < 0, -LEVEL, LEVEL).astype(np.int8).reshape(channels, 1, *spatial)
        scale = np.where(a == 0, 1.0, np.abs(a) / LEVEL).astype(np.float32)  # a == 0: the weight below is 0
        q[a.reshape(-1) == 0] = 0
        base = node.name or "batchnorm"
        w = g.add_node("DequantizeLinear", [g.add_const(base + "_w", q), g.add_const(base + "_w_scale", scale),
                                            g.add_const(base + "_w_zero", np.zeros(channels, np.int8))],
                       name=base + "_w_dq", axis=0).outputs[0]
        bias = g.add_const(base + "_bias", (beta - a * mean).astype(np.float32))
        g.add_node("Conv", [node.inputs[0], w, bias], name=base + "_as_conv", group=channels,
                   kernel_shape=spatial, replaces=node.outputs[0])
        g.remove(node)
        count += 1
    return count


def _rank(g: Graph, node) -> int | None:
    """The rank of the BatchNorm's input, where known (a 1x1 conv needs a spatial axis)."""
    shape = node.inputs[0].shape
    if shape is None:
        return None
    return len(shape)
