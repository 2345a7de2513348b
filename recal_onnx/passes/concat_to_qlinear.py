"""Concatenating quantized tensors: on the integers, or QLinearConcat (com.microsoft) when their grids differ.

Before::  DQ(q_1, s_1, zp_1), DQ(q_2, s_2, zp_2) -> Concat -> QuantizeLinear(s_y, zp_y) -> q_y
After::   every input on the output's grid:  q_1, q_2 -> Concat -> q_y
          otherwise:                          q_1, q_2 -> QLinearConcat(s_y, zp_y, s_1, zp_1, s_2, zp_2) -> q_y

A concat moves values without changing them, so each input is only requantized to the output's grid,
as the QuantizeLinear after the float concat does (GoogLeNet / Inception branches, DenseNet). An input may be a
quantized constant (ViT's class token under ``quantize_static``): its integers join as they are.
"""

from __future__ import annotations

from ..ir_edits import MS_DOMAIN, Graph, attr
from ..qdq import activation, constant_operand, quantize_node_of, same_qparams
from ..quantized_ops import replace_with_quantized


def concat_to_qlinear(g: Graph) -> int:
    count = 0
    for node in g.each("Concat"):
        if not node.inputs:
            continue
        q = quantize_node_of(g, node.outputs[0])
        acts = [activation(g, value) for value in node.inputs]
        if q is None or all(a is None for a in acts):
            continue
        dtype, rank = g.const(q.inputs[2]).dtype, g.rank(node.outputs[0])
        parts = [(a.q, a.scale, a.zero_point) if a is not None else constant_operand(g, value, rank, dtype)
                 for a, value in zip(acts, node.inputs)]
        if any(p is None or g.const(p[2]).dtype != dtype for p in parts):
            continue
        if all(same_qparams(g, scale, zp, q.inputs[1], q.inputs[2]) for _, scale, zp in parts):
            op, inputs, name, domain = "Concat", [p[0] for p in parts], node.name + "_int8", ""
        else:
            op, name, domain = "QLinearConcat", node.name + "_quant", MS_DOMAIN
            inputs = [q.inputs[1], q.inputs[2]] + [v for p in parts for v in p]
        replace_with_quantized(g, [node], None, q, op, inputs, name=name, domain=domain, axis=attr(node, "axis"))
        count += 1
    return count
