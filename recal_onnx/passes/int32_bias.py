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

from ..graph import Graph
from ..qdq import dequantized


def fold_int32_biases(g: Graph) -> int:
    count = 0
    for node in g.each("DequantizeLinear"):
        q = g.const(node.inputs[0])
        if q is None or q.dtype != np.int32 or node.outputs[0].is_graph_output():
            continue
        value = dequantized(g, node)
        if value is None:
            continue
        g.replace(node.outputs[0], g.add_const(node.inputs[0].name + "_float", value))
        inputs = [i for i in node.inputs if i is not None]
        g.remove(node)
        g.drop_if_unused(*inputs)
        count += 1
    return count
