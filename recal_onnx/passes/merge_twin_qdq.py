"""One quantizer per tensor and grid: onnxruntime's ``quantize_static(extra_options={"DedicatedQDQPair": True})``
gives every reader of a tensor its own QuantizeLinear / DequantizeLinear pair, so no Add or Conv output is read "by
one QuantizeLinear alone" and each residual add stayed float. Twins (the same input, op, scale, zero point and
attributes) compute the same integers: one stands for all.

Before::  x -> QuantizeLinear(s, zp) -> DequantizeLinear(s, zp) -> Conv
          x -> QuantizeLinear(s, zp) -> DequantizeLinear(s, zp) -> Add
After::   x -> QuantizeLinear(s, zp) -> DequantizeLinear(s, zp) -> Conv, Add
"""

from __future__ import annotations

from ..ir_edits import Graph, Node, input_of
from ..qdq import same_qparams


def merge_twin_qdq(g: Graph) -> int:
    count = 0
    changed = True
    while changed:  # merged quantizers make their dequantizers twins
        changed = False
        for node in g.each("QuantizeLinear", "DequantizeLinear"):
            if node.graph is not g.graph or node.outputs[0].is_graph_output():
                continue
            twin = next((other for other in g.consumers(node.inputs[0])
                         if other is not node and other.graph is g.graph and _twins(g, other, node)), None)
            if twin is None:
                continue
            g.replace(node.outputs[0], twin.outputs[0])
            g.remove(node)
            count += 1
            changed = True
    return count


def _twins(g: Graph, a: Node, b: Node) -> bool:
    """The same op on the same input with equal constant scale and zero point (or none) and attributes."""
    if (a.op_type, a.domain, len(a.inputs)) != (b.op_type, b.domain, len(b.inputs)) or a.inputs[0] is not b.inputs[0]:
        return False
    if {k: v.value for k, v in a.attributes.items()} != {k: v.value for k, v in b.attributes.items()}:
        return False
    if input_of(a, 2) is None:
        sa, sb = g.const(a.inputs[1]), g.const(b.inputs[1])
        return sa is not None and sb is not None and sa.shape == sb.shape and bool((sa == sb).all())
    return same_qparams(g, a.inputs[1], a.inputs[2], b.inputs[1], b.inputs[2])
