"""Average pools in a ``qdq`` model written as onnxruntime's QDQ fusion finds them: ``DQ -> pool -> Q``.

Before::  DQ -> ReduceMean(axes=[2, 3], keepdims=1) -> Q       DQ -> GlobalAveragePool -> Flatten -> Q(s, zp)
After::   DQ -> GlobalAveragePool -> Q                         DQ -> GlobalAveragePool -> Q(s, zp) -> DQ -> Flatten -> Q

onnxruntime fuses ``DQ -> GlobalAveragePool | AveragePool -> Q`` into its integer pools, and nothing else: the
dynamo exporter writes ``adaptive_avg_pool2d(x, 1)`` as a ReduceMean (the same mean), and a classifier flattens
the pooled tensor before its own input QuantizeLinear. Both pools would run in float. A shape-only op moves no
value, so quantizing before it is quantizing after it: the same numbers. (The ``qoperator`` form writes the
integer pools itself: :mod:`.pool_to_qlinear`.)
"""

from __future__ import annotations

from ..ir_edits import Graph
from ..qdq import activation
from .pool_to_qlinear import average_pool_kind, quantize_after


def fusible_qdq_pools(g: Graph) -> int:
    count = 0
    for node in g.each():
        kind = average_pool_kind(g, node) if node.inputs else None
        after = quantize_after(g, node.outputs[0]) if kind in ("global", "average") else None
        if after is None or activation(g, node.inputs[0]) is None:
            continue
        chain, q = after
        if node.op_type == "ReduceMean":
            mean, node = node, g.add_node("GlobalAveragePool", [node.inputs[0]], name=node.name + "_pool",
                                          replaces=node.outputs[0])
            g.remove(mean)
        elif not chain:
            continue  # already fusible
        if chain:
            quantized = g.add_node("QuantizeLinear", [node.outputs[0], *q.inputs[1:]], name=node.name + "_q")
            dequantized = g.add_node("DequantizeLinear", [quantized.outputs[0], *q.inputs[1:]], name=node.name + "_dq")
            for use in list(node.outputs[0].uses()):  # the chain's head, and Shape readers: the same shape
                if use.node is not quantized:
                    use.node.replace_input_with(use.idx, dequantized.outputs[0])
        count += 1
    return count
