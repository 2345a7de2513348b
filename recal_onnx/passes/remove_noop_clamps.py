"""A ReLU / ReLU6 on a dequantized tensor whose grid it cannot cut goes.

Before::  q -> DequantizeLinear(s, zp=0) -> Relu -> Conv
After::   q -> DequantizeLinear(s, zp=0) -> Conv

A clamp the QAT plan folded into the layer before it (a shared ``self.relu``, a functional ``F.relu``) stays in
the model's code and so in the export, after the output's QDQ. Its grid already starts at 0 (and ends at or
below 6 for ReLU6): the clamp changes no value. Left in, it hides the dequantized input from the conv, and
onnxruntime's QDQ fusion then runs that conv in float.
"""

from __future__ import annotations

from ..ir_edits import Graph
from ..qdq import activation
from ..quantized_ops import integer_bounds


def remove_noop_clamps(g: Graph) -> int:
    count = 0
    for node in list(g.nodes):
        if node.op_type not in ("Relu", "Clip") or node.outputs[0].is_graph_output():
            continue
        x = activation(g, node.inputs[0])
        if x is None or integer_bounds(g, node, x.scale, x.zero_point, on_grid=True) != []:
            continue
        g.replace(node.outputs[0], node.inputs[0])
        g.remove(node)
        count += 1
    return count
