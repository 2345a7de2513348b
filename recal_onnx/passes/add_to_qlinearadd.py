"""Adding two quantized tensors: QLinearAdd (com.microsoft), e.g. a residual connection.

Before::  DQ(q_a, s_a, zp_a), DQ(q_b, s_b, zp_b) -> Add -> [Relu] -> QuantizeLinear(s_y, zp_y) -> q_y
After::   q_a, q_b -> QLinearAdd(s_a, zp_a, s_b, zp_b, s_y, zp_y) -> [Max(., zp_y)] -> q_y
"""

from __future__ import annotations

from ..graph import MS_DOMAIN, Graph
from ..qdq import activation
from ..quantized_ops import output_tail, replace_with_quantized


def add_to_qlinearadd(g: Graph) -> int:
    count = 0
    for node in list(g.nodes):
        if node.op_type != "Add" or node not in g.nodes:
            continue
        a, b = activation(g, node.input[0]), activation(g, node.input[1])
        if a is None or b is None or g.ranks.get(node.input[0]) != g.ranks.get(node.input[1]):
            continue
        relu, q = output_tail(g, node.output[0])
        if q is None:
            continue
        replace_with_quantized(g, [node], relu, q, "QLinearAdd",
                               [a.q, a.scale, a.zero_point, b.q, b.scale, b.zero_point, q.input[1], q.input[2]],
                               name=node.name + "_quant", domain=MS_DOMAIN)
        count += 1
    return count
