"""A tensor's shape read off its integers: ``Shape`` (or ``Size``) of a ``DequantizeLinear`` reads the integers it
dequantizes, the same shape, so a dequantization computed only to be measured goes.

Before::  q -> DequantizeLinear(s, zp) -> Shape -> (a channel shuffle's view sizes)
After::   q -> Shape

A QAT model that reads a quantized tensor's size (ShuffleNet's ``x.size()`` before its channel shuffle) exports a
DequantizeLinear whose only reader is that ``Shape``: onnxruntime then dequantizes a whole feature map to read four
numbers (tv-shufflenet: six of them, 0.91x ``quantize_static`` on the VNNI/AMX Xeon).
"""

from __future__ import annotations

from ..ir_edits import SHAPE_READERS, Graph


def shapes_from_integers(g: Graph) -> int:
    """Point every Shape / Size of a DequantizeLinear's output at its integer input; return how many moved."""
    count = 0
    for node in g.each(*SHAPE_READERS):
        if not node.inputs or node.domain not in ("", "ai.onnx"):
            continue
        dq = g.producer(node.inputs[0])
        if dq is None or dq.op_type != "DequantizeLinear" or dq.domain not in ("", "ai.onnx"):
            continue
        node.replace_input_with(0, dq.inputs[0])
        count += 1
    return count
