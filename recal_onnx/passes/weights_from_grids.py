"""A float weight that lies on an int8 grid becomes the ``DequantizeLinear`` of those integers: its quantization,
folded into floats by a tool after the QAT export, read back exactly.

tf2onnx folds a TF QAT model's weight fake-quantization (tfmot's ``FakeQuantWithMinMaxVarsPerChannel``) and the
BatchNormalization after it into one float kernel (tf2onnx 1.17), as any tool that constant-folds a weight's
``DequantizeLinear`` would. The activations keep their Q/DQ, the weights do not, and the converter saw a float
layer. Such a weight is still ``q * step`` per output channel (the BatchNorm scale times the quantizer's step), with
integers ``|q| <= 127``: where every value of a channel is within :data:`TOLERANCE` of a multiple of one step (the
coarsest one found), the layer reads ``DequantizeLinear(q, steps, axis)``, the same values to float32 rounding, and
the later passes make it integer as any other. A weight on no such grid stays float with that reason
(:mod:`recal_onnx.float_reasons`).

Before::  DQ(x_q) -> Conv(x, W_float, b)                  (W = q * step_c, |q| <= 127)
After::   DQ(x_q) -> Conv(x, DQ(q_int8, step, axis=0), b)

It matters beyond speed: a default onnxruntime session quantizes such a float weight itself, to one per-tensor int8
step (its ``WeightBiasQuantization`` transformer, on any Conv / Gemm reading a ``DequantizeLinear``), so the file
run in a default session is not the model it holds; read on its own grid, the weight keeps its values.
"""

from __future__ import annotations

import numpy as np

from ..findings import Findings
from ..ir_edits import LAYOUT_OPS, Graph, Node, Value, input_of
from ..qdq import activation, output_axis

TOLERANCE = 1e-4  # in steps: float32 rounding of q * step * a BatchNorm scale is ~1e-5 step; off-grid values 0.1+
SAMPLED = 16  # values a channel's candidate steps are first tried on, before the whole channel
LEVELS = np.arange(1, 128, dtype=np.float64)  # the largest |q| a channel may have: 1 (ternary) to 127


def weights_from_grids(g: Graph, findings: Findings | None = None) -> int:
    count = 0
    for node in g.each("Conv", "Gemm", "MatMul"):
        w_value = input_of(node, 1)
        w = g.const(w_value)
        if w is None or w.dtype != np.float32 or not _reads_quantized(g, input_of(node, 0)):
            continue
        fitted, axis = _fit(node, w)
        if fitted is None:
            continue
        q, steps = fitted
        if np.all(steps == steps[0]):
            steps = steps[:1].reshape(())  # one step for the whole weight: per-tensor
        dq = g.add_node("DequantizeLinear", [g.add_const(w_value.name, q), g.add_const(w_value.name + "_step", steps),
                                             g.add_const(w_value.name + "_zp", np.zeros(steps.shape, np.int8))],
                        name=f"{node.name or node.op_type}_weight_dq", axis=axis)
        node.replace_input_with(1, dq.outputs[0])
        g.drop_if_unused(w_value)
        if findings is not None:
            findings.grid_weights[node.name] = int(np.abs(q).max())
        count += 1
    return count


def _reads_quantized(g: Graph, value: Value | None) -> bool:
    """Whether ``value`` is a dequantized activation, through data movement (tf2onnx's NHWC Transpose)."""
    node = g.producer(value)
    while node is not None and node.op_type in LAYOUT_OPS and node.inputs:
        value, node = node.inputs[0], g.producer(node.inputs[0])
    return activation(g, value) is not None


def on_a_grid(node: Node, w: np.ndarray) -> bool:
    """Whether the float weight ``w`` of ``node`` lies on an int8 grid per output channel."""
    return _fit(node, w)[0] is not None


def _fit(node: Node, w: np.ndarray) -> tuple[tuple[np.ndarray, np.ndarray] | None, int]:
    """``w`` as int8 and steps along its output axis (None where it lies on no grid), and that axis."""
    axis = _output_axis(node, w)
    if axis is None:
        return None, 0
    rows = np.moveaxis(w, axis, 0)
    fitted = grid_of(rows.reshape(len(rows), -1))
    if fitted is None:
        return None, axis
    return (np.moveaxis(fitted[0].reshape(rows.shape), 0, axis), fitted[1]), axis


def _output_axis(node: Node, w: np.ndarray) -> int | None:
    """The axis of ``w`` along the layer's output channels (None where the layer has no 2-D / conv weight)."""
    if node.op_type == "Conv":
        return 0 if w.ndim >= 3 else None
    return output_axis(node, 2) if w.ndim == 2 else None


def grid_of(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """``rows`` (a channel a row) as int8 ``q`` and float32 steps with ``rows[c] ~= q[c] * steps[c]`` within
    :data:`TOLERANCE` of a step, each channel on its coarsest such grid, or None where a channel lies on none."""
    values = rows.astype(np.float64)
    if values.size == 0 or not np.isfinite(values).all():
        return None
    peak = np.abs(values).max(axis=1)
    live = peak > 0
    steps = np.ones(len(rows))
    sample = values[:, np.linspace(0, values.shape[1] - 1, min(SAMPLED, values.shape[1])).astype(int)]
    for c in np.flatnonzero(live):
        ratios = sample[c][None, :] / peak[c] * LEVELS[:, None]  # q / level for each level tried
        for level in LEVELS[np.abs(ratios - np.round(ratios)).max(axis=1) <= TOLERANCE]:
            scaled = values[c] / peak[c] * level
            if np.abs(scaled - np.round(scaled)).max() <= TOLERANCE:
                steps[c] = peak[c] / level
                break
        else:
            return None
    if live.any():
        steps[~live] = steps[live].max()  # an all-zero channel: any step holds its zeros
    steps32 = steps.astype(np.float32)
    q = np.round(values / steps[:, None]).astype(np.int8)
    return q, steps32
