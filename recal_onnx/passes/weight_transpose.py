"""A transposed constant weight: ``DQ(w_int8) -> Transpose`` becomes ``DQ(w_int8ᵀ)`` (axis moved with it).

torch's exporters write a Linear on a 3-D input (``[batch, tokens, hidden]``: every transformer layer) as
``MatMul(x, Transpose(DQ(w)))``; with the transpose folded into the integers the MatMul reads a plain
dequantized weight, which the dense-layer pass turns into an integer op.

Before::  w_int8 [N, K] -> DequantizeLinear(s_w [N], axis=0) -> Transpose(perm=[1, 0]) -> MatMul
After::   w_int8ᵀ [K, N] -> DequantizeLinear(s_w [N], axis=1) -> MatMul
"""

from __future__ import annotations

import numpy as np

from ..graph import Graph, attr
from ..qdq import weight


def fold_weight_transposes(g: Graph) -> int:
    count = 0
    for node in list(g.nodes):
        if node.op_type != "Transpose" or node.output[0] in g.outputs:
            continue
        w = weight(g, node.input[0])
        if w is None:
            continue
        perm = list(attr(node, "perm", None) or reversed(range(w.q.ndim)))
        per_axis = w.scale.size != 1
        if per_axis and w.scale.ndim != 1:
            continue  # blocked quantization: not a layout this pass moves
        dq = w.dq
        q = g.add_const(dq.input[0] + "_t", np.ascontiguousarray(np.transpose(w.q, perm)))
        inputs = [q, dq.input[1]] + list(dq.input[2:3])
        attrs = {"axis": perm.index(w.axis)} if per_axis else {}
        g.remove(node)
        g.add_node("DequantizeLinear", inputs, [node.output[0]], name=(node.name or "transpose") + "_weight",
                   **attrs)
        if not g.uses(dq.output[0]):  # the untransposed copy goes now, not at the end (large models)
            g.remove(dq)
            g.drop_if_unused(dq.input[0])
        count += 1
    return count
