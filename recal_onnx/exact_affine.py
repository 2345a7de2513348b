"""A per-channel affine between two quantizers, ``Q(a * DQ(q) + b)``, held as an integer depthwise conv that computes
exactly what onnxruntime computes for the QDQ model as written, checked on every input value.

Its output is a function of one 8-bit integer per channel, so exactness is a finite question: onnxruntime runs the
QDQ form (``DequantizeLinear -> BatchNormalization -> QuantizeLinear``, optimizations off) on all 256 values of
every channel, and per channel the search looks for an int8 weight ``w`` (|w| <= 64: exact on AVX2 too), its float
scale and an int32 bias whose QLinearConv arithmetic (``round(float(w * (q - zp_x) + bias) * (s_x * s_w / s_y)) +
zp_y``, float32 as onnxruntime computes it) gives the same 256 integers. A weight of +-64 with the bias rounded onto
its grid, what the conversion did before, differs near 1 value in 64 on a rounding boundary (un-pre-processed
``quantize_static`` models hold dozens of such BatchNorms).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from onnx import helper, numpy_helper

LEVELS = 64  # the largest |int8 weight| tried: beyond +-64 int8 weights saturate on x86 without VNNI
ULPS = (0, 1, -1, 2, -2)  # nudges of the weight scale tried, in float32 ulps


@dataclass(frozen=True)
class ExactAffine:
    weight: np.ndarray  # int8 per channel
    scale: np.ndarray  # float32 per channel
    bias: np.ndarray  # int32 per channel
    inexact: int  # channels where no choice matched every value (the closest kept)
    differing: int  # values (channel, input) that differ there


def reference_table(bn: dict, x_scale, x_zero, y_scale, y_zero) -> np.ndarray:
    """What onnxruntime computes for ``Q(BatchNormalization(DQ(q)))`` as written, on every input value of every
    channel: ``[channels, 256]`` output integers (``bn``: the BatchNorm's gamma, beta, mean, var, epsilon)."""
    import onnxruntime as ort

    channels = bn["gamma"].size
    x_type = helper.np_dtype_to_tensor_dtype(x_zero.dtype)
    inputs = np.arange(256).astype(np.int16) + (np.iinfo(x_zero.dtype).min if x_zero.dtype == np.int8 else 0)
    feed = np.broadcast_to(inputs.astype(x_zero.dtype).reshape(1, 1, 256, 1), (1, channels, 256, 1)).copy()
    inits = [numpy_helper.from_array(np.asarray(v), n) for n, v in (
        ("xs", x_scale), ("xz", x_zero), ("ys", y_scale), ("yz", y_zero), ("g", bn["gamma"]), ("b", bn["beta"]),
        ("m", bn["mean"]), ("v", bn["var"]))]
    nodes = [helper.make_node("DequantizeLinear", ["x", "xs", "xz"], ["d"]),
             helper.make_node("BatchNormalization", ["d", "g", "b", "m", "v"], ["n"], epsilon=bn["epsilon"]),
             helper.make_node("QuantizeLinear", ["n", "ys", "yz"], ["y"])]
    graph = helper.make_graph(nodes, "affine", [helper.make_tensor_value_info("x", x_type, feed.shape)],
                              [helper.make_tensor_value_info("y", helper.np_dtype_to_tensor_dtype(y_zero.dtype),
                                                             feed.shape)], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.log_severity_level = 3
    run = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return run.run(None, {"x": feed})[0].reshape(channels, 256).astype(np.int32)


def exact_affine(a: np.ndarray, b: np.ndarray, table: np.ndarray, x_scale: float, x_zero: np.ndarray,
                 y_scale: float, y_zero: np.ndarray) -> ExactAffine:
    """Per channel (factor ``a``, shift ``b``), the int8 weight, float32 weight scale and int32 bias that reproduce
    ``table`` (the QDQ model's integers, :func:`reference_table`) in onnxruntime's QLinearConv arithmetic; where
    none does, the closest. Each round searches only the channels still unmatched."""
    channels = a.size
    low = np.iinfo(x_zero.dtype).min if x_zero.dtype == np.int8 else 0
    centred = (np.arange(256) + low - int(x_zero)).astype(np.int64)  # q - zp_x
    y_lo, y_hi = np.iinfo(y_zero.dtype).min, np.iinfo(y_zero.dtype).max
    sx, sy = np.float32(x_scale), np.float32(y_scale)
    best_w = np.zeros(channels, np.int8)
    best_s = np.ones(channels, np.float32)
    best_b = np.zeros(channels, np.int32)
    best_miss = np.full(channels, 257)
    zero = a == 0  # a constant channel: weight 0, its value in the bias alone (on a weight scale of 1)
    if zero.any():
        bias = np.clip(np.round(b[zero] / np.float64(sx)), -2**31, 2**31 - 1)
        got = np.round(bias.astype(np.float32)[:, None] * (sx / sy) + np.zeros((1, 256), np.float32))
        best_b[zero], best_miss[zero] = bias, _count(got, table[zero], y_zero, y_lo, y_hi)
    for level in range(LEVELS, 0, -1):
        open_ = np.flatnonzero((best_miss > 0) & ~zero)
        if not open_.size:
            break
        weight = np.where(a[open_] < 0, -level, level)
        base = (np.abs(a[open_]) / level).astype(np.float32)
        for ulp in ULPS:
            scale = _nudge(base, ulp)
            mult = (sx * scale) / sy  # float32, as onnxruntime forms a QLinearConv's multiplier
            ideal = np.round(b[open_] / (np.float64(sx) * scale.astype(np.float64)))
            for offset in (0, -1, 1):
                bias = np.clip(ideal + offset, -2**31, 2**31 - 1)
                acc = weight[:, None] * centred[None, :] + bias[:, None]
                got = np.round(acc.astype(np.float32) * mult[:, None])  # half to even, as onnxruntime rounds
                miss = _count(got, table[open_], y_zero, y_lo, y_hi)
                better = miss < best_miss[open_]
                chosen = open_[better]
                best_w[chosen], best_s[chosen], best_b[chosen] = weight[better], scale[better], bias[better]
                best_miss[chosen] = miss[better]
    inexact = best_miss > 0
    return ExactAffine(best_w, best_s, best_b, int(inexact.sum()), int(best_miss[inexact].sum()))


def _nudge(values: np.ndarray, ulps: int) -> np.ndarray:
    out = values.copy()
    for _ in range(abs(ulps)):
        out = np.nextafter(out, np.float32(np.inf if ulps > 0 else 0)).astype(np.float32)
    return out


def _count(got: np.ndarray, table: np.ndarray, y_zero, y_lo: int, y_hi: int) -> np.ndarray:
    values = np.clip(got + int(y_zero), y_lo, y_hi)
    return np.count_nonzero(values != table, axis=1)

