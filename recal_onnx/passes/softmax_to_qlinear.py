"""A softmax of a quantized tensor whose output is quantized: QLinearSoftmax (com.microsoft) where it is exact, else
kept float where onnxruntime cannot fuse it into its inexact kernel.

Before::  q -> DequantizeLinear(s, zp) -> Softmax -> QuantizeLinear(s2, zp2) -> q2
After::   q -> QLinearSoftmax(s, zp, 1 / (K + 0.5), zp2) -> q2          (qoperator; 1 / s2 is an integer K)
   or::   q -> Cast -> [Sub(zp)] -> Mul(s) -> Softmax -> QuantizeLinear(s2, zp2) -> q2   (otherwise)

onnxruntime's QLinearSoftmax looks ``exp`` up in a table and writes ``round(p * floor(1 / y_scale))``: the
output grid it computes on is ``1 / floor(1 / s2)``, not ``s2``. That is the same grid only where ``1 / s2`` is an
integer ``K`` (``quantize_static`` writes ``s2 = 1 / 255`` or ``1 / 256``); ``float32(1 / 255)`` inverts to
254.99998, which the kernel floors to 254, one step off for every probability above about one half. A default
onnxruntime session fuses ``DQ -> Softmax -> Q`` (both 8-bit of one signedness) into that kernel by itself, so the
QDQ file as written and the file run by onnxruntime already differ there (0.19% of a BERT's attention
probabilities).

So the converter writes QLinearSoftmax itself where ``1 / s2`` is an integer ``K``, handing the kernel a ``y_scale``
that floors to ``K`` (the integers then are ``round(p / s2)``, as the QDQ model means them): fast and exact. Where
it is not (a scale calibrated from the probabilities' range), or in the ``qdq`` format where the runtime fuses with
``s2`` itself, the softmax stays float and its input is dequantized by the ops ``DequantizeLinear`` computes
(``(float(q) - zp) * s``, the same float values), which onnxruntime does not fuse; the reason is recorded.
"""

from __future__ import annotations

import numpy as np
import onnx

from ..findings import Findings
from ..ir_edits import MS_DOMAIN, Graph, Node, attr, set_input
from ..qdq import QTensor, activation, quantize_node_of, scalar
from ..quantized_ops import replace_with_quantized

INTEGER_GRID = 2.0 ** -20  # 1 / s2 within this share of an integer K: round(p / s2) is round(p * K) (bar a boundary)


def softmax_to_qlinear(g: Graph, integer: bool = True, findings: Findings | None = None) -> int:
    """Rewrite each quantized softmax; ``integer``: the qoperator format (QLinearSoftmax where exact)."""
    count = 0
    for node in list(g.each("Softmax")):
        x, q = activation(g, node.inputs[0]), quantize_node_of(g, node.outputs[0])
        if x is None or q is None:
            continue
        in_type, out_type = g.const(x.zero_point).dtype, g.const(q.inputs[2]).dtype
        if in_type != out_type or in_type not in (np.uint8, np.int8):
            continue  # onnxruntime fuses only 8-bit tensors of one signedness: it stays as written, exact
        s2 = np.float32(scalar(g, q.inputs[1]))
        if not np.isfinite(s2) or s2 <= 0:
            continue  # no grid at all: the input checks and the verification say what is wrong
        k = round(1.0 / float(s2))
        kernel_grid = np.floor(np.float32(1.0) / s2)  # what onnxruntime's QLinearSoftmax multiplies by
        on_grid = k >= 1 and abs(1.0 / float(s2) - k) <= INTEGER_GRID * k
        kernel_scale = _kernel_scale(k) if on_grid else None  # None: float32 holds no scale flooring to k
        on_grid = kernel_scale is not None
        if on_grid and in_type == np.uint8 and not integer and kernel_grid == k:
            continue  # the runtime's own fusion computes on the model's grid: leave it the fast form
        if on_grid and in_type == np.uint8 and integer:  # (its int8 kernel wraps a probability of 1 past 127)
            y_scale = g.add_const(q.inputs[1].name + "_kernel", kernel_scale)
            replace_with_quantized(g, [node], None, q,
                                   "QLinearSoftmax", [x.q, x.scale, x.zero_point, y_scale, q.inputs[2]],
                                   name=node.name + "_quant", domain=MS_DOMAIN, axis=_axis(g, node), opset=g.opset)
            count += 1
            continue
        _dequantize_apart(g, node, x)
        if findings is not None:
            findings.kept_float[node.name] = ("Softmax", _why_float(float(s2), int(kernel_grid), on_grid, in_type))
        count += 1
    return count


def _kernel_scale(k: int) -> np.ndarray | None:
    """A ``y_scale`` whose inverse onnxruntime's QLinearSoftmax floors to ``k``; None where float32 holds none (a
    ``k`` past 2**24)."""
    y = np.float32(1.0 / (k + 0.5))
    return np.array(y, np.float32) if y > 0 and np.floor(np.float32(1.0) / y) == k else None


def _axis(g: Graph, node: Node) -> int:
    return attr(node, "axis", -1 if g.opset >= 13 else 1)


def _dequantize_apart(g: Graph, node: Node, x: QTensor) -> None:
    """The softmax reads ``x`` dequantized by Cast / Sub / Mul (the values DequantizeLinear computes) rather than by
    a DequantizeLinear, which onnxruntime would fuse with the softmax and its QuantizeLinear."""
    base = node.name or "softmax"
    value = g.add_node("Cast", [x.q], name=base + "_dequantize_cast", to=onnx.TensorProto.FLOAT).outputs[0]
    zero_point = g.const(x.zero_point)
    if np.any(zero_point != 0):
        zp = g.add_const(base + "_zero_point", zero_point.astype(np.float32))
        value = g.add_node("Sub", [value, zp], name=base + "_dequantize_sub").outputs[0]
    value = g.add_node("Mul", [value, x.scale], name=base + "_dequantize_mul").outputs[0]
    set_input(node, 0, value)


def _why_float(s2: float, kernel_grid: int, on_grid: bool, dtype: np.dtype) -> str:
    if on_grid and dtype == np.uint8:
        return (f"its output scale {s2:.7g} inverts to {1 / s2:.5f}, which onnxruntime's QLinearSoftmax floors to "
                f"{kernel_grid}: fused in a qdq file it rounds to another grid; the qoperator format writes it "
                "exactly")
    if on_grid:
        return "its output is int8, and onnxruntime's int8 QLinearSoftmax wraps a probability that rounds past 127"
    return (f"its output scale {s2:.7g} is not 1/K for an integer K, and onnxruntime's QLinearSoftmax computes on "
            f"the grid 1/floor(1/scale) = 1/{kernel_grid}: it stays float (dequantized so onnxruntime does not "
            "fuse it)")
