"""A BatchNorm on a quantized activation becomes a depthwise 1x1 conv, so the integer passes take it.

Before::  q -> DequantizeLinear -> BatchNormalization(gamma, beta, mean, var) -> y
After::   q -> DequantizeLinear -> Conv(DQ(w_int8, s_w, axis=0), bias, group=C, 1x1) -> y

A pre-activation BatchNorm (DenseNet's ``BN -> ReLU -> conv`` on concatenated features, ResNet v2) has no conv
before it to fold into. Its per-channel factor ``a = gamma / sqrt(var + eps)`` is held exactly as an int8 weight
of +-64 with scale ``|a| / 64`` (64: int8 and exact on every CPU, as 7-bit QAT weights are), and its shift
``beta - a * mean`` as the bias, which the conv pass puts on its int32 grid (off by at most half a step of
``s_x * s_w``, a 128th of an input step or less). The ReLU after it, and the QuantizeLinear the next conv reads,
then make it a QLinearConv like any other.

Where the BatchNorm sits between two quantizers (``Q -> DQ -> BatchNormalization -> Q``: what ``quantize_static``
leaves of a conv's BatchNorm when the model was not pre-processed), its output is a function of one 8-bit value
per channel, and the weight, its scale and the bias are chosen so that the integer conv gives what onnxruntime
gives for the QDQ model as written on all 256 values of every channel (:mod:`recal_onnx.exact_affine`); the
conversion says how many such BatchNorms it made exact, and any channel it could not.
"""

from __future__ import annotations

import numpy as np

from recal_core.modifiers import REDUCED_WEIGHT_LEVELS

from ..exact_affine import exact_affine, reference_table
from ..findings import Findings
from ..ir_edits import Graph, attr, input_of
from ..qdq import EIGHT_BITS, activation

LEVEL = REDUCED_WEIGHT_LEVELS  # the int8 weight every channel's factor is written as (its sign, times 64)


def batchnorm_to_conv(g: Graph, findings: Findings | None = None) -> int:
    count, exact, inexact = 0, 0, []
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
        base = node.name or "batchnorm"
        solved = _exact(g, node, x, gamma, beta, mean, var, a)
        if solved is not None:
            fit, bias_value = solved
            q, scale = fit.weight.reshape(channels, 1, *spatial), fit.scale
            bias = g.add_const(base + "_bias", bias_value)
            exact += 1
            if fit.inexact:
                inexact.append(f"{base!r}: {fit.inexact} channels, {fit.differing} of their input values")
        else:
            q = np.where(a < 0, -LEVEL, LEVEL).astype(np.int8).reshape(channels, 1, *spatial)
            scale = np.where(a == 0, 1.0, np.abs(a) / LEVEL).astype(np.float32)  # a == 0: the weight below is 0
            q[a.reshape(-1) == 0] = 0
            bias = g.add_const(base + "_bias", (beta - a * mean).astype(np.float32))
        w = g.add_node("DequantizeLinear", [g.add_const(base + "_w", q), g.add_const(base + "_w_scale", scale),
                                            g.add_const(base + "_w_zero", np.zeros(channels, np.int8))],
                       name=base + "_w_dq", axis=0).outputs[0]
        g.add_node("Conv", [node.inputs[0], w, bias], name=base + "_as_conv", group=channels,
                   kernel_shape=spatial, replaces=node.outputs[0])
        g.remove(node)
        count += 1
    if exact and findings is not None:
        findings.notes.append(
            f"{exact} BatchNormalization nodes between two quantizers run as integer depthwise convs that give "
            "onnxruntime's own integers for the QDQ model as written on all 256 input values of every channel"
            + (f", except {'; '.join(inexact)} (no int8 weight within +-64 matched every value: the closest kept)"
               if inexact else ""))
    return count


def _exact(g: Graph, node, x, gamma, beta, mean, var, a):
    """``(ExactAffine, its float bias)`` where the BatchNorm reads a per-tensor 8-bit activation and only a per-tensor
    8-bit QuantizeLinear reads it, else None. The bias is written in float (``bias_int32 * s_x * s_w``), which the
    conv pass reads back onto its int32 grid: None too where that would not give back the same integers."""
    readers = g.consumers(node.outputs[0])
    if len(readers) != 1 or readers[0].op_type != "QuantizeLinear" or node.outputs[0] in g.graph.outputs:
        return None
    quantize = readers[0]
    y_scale, y_zero = g.const(input_of(quantize, 1)), g.const(input_of(quantize, 2))
    x_scale, x_zero = g.const(x.scale), g.const(x.zero_point)
    if y_scale is None or y_zero is None or y_scale.size != 1 or y_zero.size != 1 or y_zero.dtype not in EIGHT_BITS:
        return None
    x_scale, y_scale = np.float32(x_scale.reshape(())), np.float32(y_scale.reshape(()))
    x_zero, y_zero = x_zero.reshape(()), y_zero.reshape(())
    b = beta - a * mean
    params = {"gamma": gamma.astype(np.float32), "beta": beta.astype(np.float32), "mean": mean.astype(np.float32),
              "var": var.astype(np.float32), "epsilon": float(attr(node, "epsilon", 1e-5))}
    table = reference_table(params, x_scale, x_zero, y_scale, y_zero)
    fit = exact_affine(a, b, table, x_scale, x_zero, y_scale, y_zero)
    step = np.float64(x_scale) * fit.scale.astype(np.float64)
    value = (fit.bias.astype(np.float64) * step).astype(np.float32)
    if not np.array_equal(np.round(value.astype(np.float64) / step), fit.bias):
        return None
    return fit, value


def _rank(g: Graph, node) -> int | None:
    """The rank of the BatchNorm's input, where known (a 1x1 conv needs a spatial axis)."""
    shape = node.inputs[0].shape
    if shape is None:
        return None
    return len(shape)
