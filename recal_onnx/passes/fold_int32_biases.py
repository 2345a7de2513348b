"""Biases written as integers: ``DequantizeLinear(int32, s_b, 0)`` (onnxruntime's ``quantize_static``, Brevitas,
AIMET and recal's own ``format="qdq"`` write them so) become the float constant they mean.

Before::  b_int32, s_b -> DequantizeLinear -> Conv / Gemm (bias), or MatMul -> Add(bias)
After::   b_float (= float32(b_int32) * s_b, exactly what the QAT model computes) -> Conv / Gemm / Add

The quantized layer passes then put the bias back on the integers in steps of ``s_x * s_w``. Where ``s_b`` is that
product (what every tool writes), the round trip is exact for every bias below 2^24 steps; a bias on another grid is
rounded to it and reported, with its layer, in ``findings.rounded_biases``.

A ``DequantizeLinear`` of an int32 constant is never a weight (weights are 8 bits or fewer), so every such constant
is folded; one with a zero point other than 0 is folded the same way (its meaning is ``(q - zp) * s``). A bias of
8 or 16 bits (AMD Quark's XINT8 quantizes biases as it does weights: int8 on a power-of-two grid) is folded for
the readers that take it as a bias (a Conv's or Gemm's third input); others read it as before: torch.onnx shares
equal biases (wav2vec2's positional conv and its attention projections, all zeros), which ``quantize_static`` then
quantizes once as an Add's uint8 operand.
"""

from __future__ import annotations

import numpy as np

from ..ir_edits import Graph
from ..qdq import dequantized

BIASED = {"Conv", "ConvTranspose", "Gemm"}
# the inputs that read a vector as a parameter, not as a weight: a bias, and BatchNormalization's scale, bias, mean
# and variance (quantize_static quantizes a BatchNorm no conv took in: its scale as an int8 weight, its bias as int32)
PARAMETERS = {**{op: (2,) for op in BIASED}, "BatchNormalization": (1, 2, 3, 4)}


def fold_int32_biases(g: Graph) -> int:
    count = 0
    for node in g.each("DequantizeLinear"):
        q = g.const(node.inputs[0])
        if q is None or node.outputs[0].is_graph_output():
            continue
        biases = [use for use in node.outputs[0].uses() if use.idx in PARAMETERS.get(use.node.op_type, ())]
        if not (q.dtype == np.int32 or (q.dtype in NARROW and q.ndim == 1 and biases)):
            continue
        value = dequantized(g, node)
        if value is None:
            continue
        folded = g.add_const(node.inputs[0].name + "_float", value)
        if q.dtype == np.int32:  # never a weight: every reader reads the float
            g.replace(node.outputs[0], folded)
        for use in biases if q.dtype != np.int32 else ():
            use.node.replace_input_with(use.idx, folded)
        count += 1
        if not g.uses(node.outputs[0]):
            inputs = [i for i in node.inputs if i is not None]
            g.remove(node)
            g.drop_if_unused(*inputs)
    return count


NARROW = (np.int8, np.uint8, np.int16, np.uint16)  # a bias written on a weight's or an activation's integers
