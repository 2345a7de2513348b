"""Adding or multiplying two quantized tensors: QLinearAdd / QLinearMul (com.microsoft), e.g. a residual connection
or squeeze-excitation's gate (the pooled sigmoid broadcast over the feature map) and a SiLU's ``x * sigmoid(x)``.

Before::  DQ(q_a, s_a, zp_a), DQ(q_b, s_b, zp_b) -> Add | Mul -> [Relu] -> QuantizeLinear(s_y, zp_y) -> q_y
After::   q_a, q_b -> QLinearAdd | QLinearMul(s_a, zp_a, s_b, zp_b, s_y, zp_y) -> [Max(., zp_y)] -> q_y

One operand may be a quantized constant (``DequantizeLinear`` of constant integers, per tensor), as
``quantize_static`` writes a bias added after a MatMul or the scalars of an attention's scale and of a GELU: its
integers are moved to the other operand's type (+-128 with the zero point, the same values) and given its rank.

onnxruntime computes both in float from the integers and rounds once to the output's grid: what the QDQ model
computes. Both operands must have the same rank (the kernels broadcast dimensions of size 1, not missing ones).
"""

from __future__ import annotations

from ..ir_edits import MS_DOMAIN, Graph
from ..qdq import activation, constant_operand
from ..quantized_ops import output_tail, replace_with_quantized

QUANTIZED = {"Add": "QLinearAdd", "Mul": "QLinearMul"}


def binary_to_qlinear(g: Graph) -> int:
    count = 0
    for node in g.each(*QUANTIZED):
        acts = [activation(g, v) for v in node.inputs[:2]]
        known = [a for a in acts if a is not None]
        relu, q = output_tail(g, node.outputs[0])
        if not known or q is None:
            continue
        rank, dtype = g.rank(known[0].dq.outputs[0]), g.const(known[0].zero_point).dtype
        operands = [(a.q, a.scale, a.zero_point) if a is not None and g.rank(v) == rank else
                    None if a is not None else constant_operand(g, v, rank, dtype)
                    for a, v in zip(acts, node.inputs[:2])]
        if rank is None or None in operands or any(g.const(o[2]).dtype != dtype for o in operands):
            continue
        replace_with_quantized(g, [node], relu, q, QUANTIZED[node.op_type],
                               [*operands[0], *operands[1], q.inputs[1], q.inputs[2]],
                               name=node.name + "_quant", domain=MS_DOMAIN)
        count += 1
    return count
