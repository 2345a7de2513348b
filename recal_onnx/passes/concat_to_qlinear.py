"""Concatenating quantized tensors: on the integers, or QLinearConcat (com.microsoft) when their grids differ.

Before::  DQ(q_1, s_1, zp_1), DQ(q_2, s_2, zp_2) -> Concat -> QuantizeLinear(s_y, zp_y) -> q_y
After::   every input on the output's grid:  q_1, q_2 -> Concat -> q_y
          otherwise:                          q_1, q_2 -> QLinearConcat(s_y, zp_y, s_1, zp_1, s_2, zp_2) -> q_y

A concat moves values without changing them, so each input is only requantized to the output's grid,
as the QuantizeLinear after the float concat does (GoogLeNet / Inception branches, DenseNet).
"""

from __future__ import annotations

from ..graph import MS_DOMAIN, Graph, attr
from ..qdq import activation, quantize_node_of, same_qparams
from ..quantized_ops import replace_with_quantized


def concat_to_qlinear(g: Graph) -> int:
    count = 0
    for node in g.each("Concat"):
        if not node.inputs:
            continue
        parts = [activation(g, value) for value in node.inputs]
        q = quantize_node_of(g, node.outputs[0])
        if q is None or any(p is None for p in parts):
            continue
        dtype = g.const(q.inputs[2]).dtype
        if any(g.const(p.zero_point).dtype != dtype for p in parts):
            continue
        if all(same_qparams(g, p.scale, p.zero_point, q.inputs[1], q.inputs[2]) for p in parts):
            op, inputs, name, domain = "Concat", [p.q for p in parts], node.name + "_int8", ""
        else:
            op, name, domain = "QLinearConcat", node.name + "_quant", MS_DOMAIN
            inputs = [q.inputs[1], q.inputs[2]] + [v for p in parts for v in (p.q, p.scale, p.zero_point)]
        replace_with_quantized(g, [node], None, q, op, inputs, name=name, domain=domain, axis=attr(node, "axis"))
        count += 1
    return count
