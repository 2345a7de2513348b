"""Biases written as integers: ``DequantizeLinear(int32, s_b, 0)`` (onnxruntime's ``quantize_static``, Brevitas,
AIMET and recal's own ``format="qdq"`` write them so) become the float constant they mean.

Before::  b_int32, s_b -> DequantizeLinear -> Conv / Gemm (bias), or MatMul -> Add(bias)
After::   b_float (= float32(b_int32) * s_b, exactly what the QAT model computes) -> Conv / Gemm / Add

The quantized layer passes then put the bias back on the integers in steps of ``s_x * s_w``. Where ``s_b`` is that
product (what every tool writes), the round trip is exact for every bias below 2^24 steps; a bias on another grid is
rounded to it and reported, with its layer, in ``findings.rounded_biases``.

A ``DequantizeLinear`` of an int32 constant is never a weight (weights are 8 bits or fewer), so every such constant
is folded; one with a zero point other than 0 is folded the same way (its meaning is ``(q - zp) * s``).
"""

from __future__ import annotations

import numpy as np

from ..graph import Graph, input_of
from ..qdq import along_axis


def fold_int32_biases(g: Graph) -> int:
    count = 0
    for node in g.each("DequantizeLinear"):
        q = g.const(node.inputs[0])
        scale, zero_point = g.const(input_of(node, 1)), input_of(node, 2)
        if q is None or q.dtype != np.int32 or scale is None or node.outputs[0].is_graph_output():
            continue
        if zero_point is not None and not g.is_const(zero_point):
            continue
        zp = g.const(zero_point) if zero_point is not None else np.zeros((), np.int32)
        shaped = along_axis(node, q, scale, zp)
        if shaped is None:
            continue
        scale, zp = shaped
        # onnxruntime's DequantizeLinear: float32(q - zp) * scale, in float32
        value = ((q.astype(np.int64) - zp.astype(np.int64)).astype(np.float32) * scale.astype(np.float32))
        g.replace(node.outputs[0], g.add_const(node.inputs[0].name + "_float", value))
        inputs = [i for i in node.inputs if i is not None]
        g.remove(node)
        g.drop_if_unused(*inputs)
        count += 1
    return count
