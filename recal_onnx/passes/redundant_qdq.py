"""Remove requantization that changes nothing.

Before::  q -> DequantizeLinear(s, zp) -> QuantizeLinear(s, zp) -> q2 -> ...
After::   q -> ...                       (every reader of q2 reads q)
"""

from __future__ import annotations

from ..graph import Graph
from ..qdq import activation, same_qparams


def remove_redundant_qdq(g: Graph) -> int:
    count = 0
    for node in g.each("QuantizeLinear"):
        if len(node.input) < 3:
            continue
        x = activation(g, node.input[0])
        if x is None or not same_qparams(g, x.scale, x.zero_point, node.input[1], node.input[2]):
            continue
        out = node.output[0]
        if out in g.outputs:
            continue
        g.remove(node)
        g.replace_uses(out, x.q)
        count += 1
    return count
