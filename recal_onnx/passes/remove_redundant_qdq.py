"""Remove requantization that changes nothing.

Before::  q -> DequantizeLinear(s, zp) -> QuantizeLinear(s, zp) -> q2 -> ...
After::   q -> ...                       (every reader of q2 reads q)
"""

from __future__ import annotations

from ..ir_edits import Graph
from ..qdq import activation, same_qparams


def remove_redundant_qdq(g: Graph) -> int:
    count = 0
    for node in g.each("QuantizeLinear"):
        if len(node.inputs) < 3:
            continue
        x = activation(g, node.inputs[0])
        if x is None or not same_qparams(g, x.scale, x.zero_point, node.inputs[1], node.inputs[2]):
            continue
        out = node.outputs[0]
        if out.is_graph_output():
            continue
        g.replace(out, x.q)
        g.remove(node)
        count += 1
    return count
