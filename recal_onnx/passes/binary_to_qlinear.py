"""Adding or multiplying two quantized tensors: QLinearAdd / QLinearMul (com.microsoft), e.g. a residual connection
or squeeze-excitation's gate (the pooled sigmoid broadcast over the feature map) and a SiLU's ``x * sigmoid(x)``.

Before::  DQ(q_a, s_a, zp_a), DQ(q_b, s_b, zp_b) -> Add | Mul -> [Relu] -> QuantizeLinear(s_y, zp_y) -> q_y
After::   q_a, q_b -> QLinearAdd | QLinearMul(s_a, zp_a, s_b, zp_b, s_y, zp_y) -> [Max(., zp_y)] -> q_y

onnxruntime computes both in float from the integers and rounds once to the output's grid: what the QDQ model
computes. Both operands must have the same rank (the kernels broadcast dimensions of size 1, not missing ones).
"""

from __future__ import annotations

from ..graph import MS_DOMAIN, Graph
from ..qdq import activation
from ..quantized_ops import output_tail, replace_with_quantized

QUANTIZED = {"Add": "QLinearAdd", "Mul": "QLinearMul"}


def binary_to_qlinear(g: Graph) -> int:
    count = 0
    for node in g.each(*QUANTIZED):
        a, b = activation(g, node.inputs[0]), activation(g, node.inputs[1])
        if a is None or b is None or g.rank(node.inputs[0]) != g.rank(node.inputs[1]):
            continue
        relu, q = output_tail(g, node.outputs[0])
        if q is None:
            continue
        replace_with_quantized(g, [node], relu, q, QUANTIZED[node.op_type],
                               [a.q, a.scale, a.zero_point, b.q, b.scale, b.zero_point, q.inputs[1], q.inputs[2]],
                               name=node.name + "_quant", domain=MS_DOMAIN)
        count += 1
    return count
