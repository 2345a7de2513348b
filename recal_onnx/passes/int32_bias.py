"""Biases written as integers: ``DequantizeLinear(int32, s_b, 0)`` (onnxruntime's ``quantize_static``, Brevitas,
AIMET and recal's own ``format="qdq"`` write them so) become the float constant they mean.

Before::  b_int32, s_b -> DequantizeLinear -> Conv / Gemm (bias), or MatMul -> Add(bias)
After::   b_float (= float32(b_int32) * s_b, exactly what the QAT model computes) -> Conv / Gemm / Add

The quantized layer passes then put the bias back on the integers in steps of ``s_x * s_w``. Where ``s_b`` is that
product (what every tool writes), the round trip is exact for every bias below 2^24 steps; a bias on another grid is
rounded to it and reported, with its layer, in ``findings.rounded_biases``.

A ``DequantizeLinear`` of an int32 constant is never a weight (weights are 8 bits or fewer), so every such constant
is folded; one with a zero point other than 0 is folded the same way (its meaning is ``(q - zp) * s``). A bias of
8 or 16 bits (AMD Quark's XINT8 quantizes biases as it does weights: int8 on a power-of-two grid) is folded where
every reader takes it as a bias (a Conv's or Gemm's third input): the same constant would be a weight elsewhere.
"""

from __future__ import annotations

import numpy as np

from ..graph import Graph
from ..qdq import dequantized

BIASED = {"Conv", "ConvTranspose", "Gemm"}


def fold_int32_biases(g: Graph) -> int:
    count = 0
    for node in g.each("DequantizeLinear"):
        q = g.const(node.inputs[0])
        if q is None or node.outputs[0].is_graph_output() or not (q.dtype == np.int32 or _only_a_bias(g, node, q)):
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


def _only_a_bias(g: Graph, node, q: np.ndarray) -> bool:
    """An 8- or 16-bit integer vector that every reader takes as its bias (Conv / ConvTranspose / Gemm input 2)."""
    readers = node.outputs[0].uses()
    return (q.dtype in (np.int8, np.uint8, np.int16, np.uint16) and q.ndim == 1 and bool(readers)
            and all(use.node.op_type in BIASED and use.idx == 2 for use in readers))
