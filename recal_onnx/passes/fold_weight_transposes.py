"""A transposed constant weight: ``DQ(w_int8) -> Transpose`` becomes ``DQ(w_int8ᵀ)`` (axis moved with it).

torch's exporters write a Linear on a 3-D input (``[batch, tokens, hidden]``: every transformer layer) as
``MatMul(x, Transpose(DQ(w)))``; with the transpose folded into the integers the MatMul reads a plain
dequantized weight, which the dense-layer pass turns into an integer op.

Before::  w_int8 [N, K] -> DequantizeLinear(s_w [N], axis=0) -> Transpose(perm=[1, 0]) -> MatMul
After::   w_int8ᵀ [K, N] -> DequantizeLinear(s_w [N], axis=1) -> MatMul
"""

from __future__ import annotations

import numpy as np

from ..ir_edits import Graph, attr
from ..qdq import replace_moved_weight, weight


def fold_weight_transposes(g: Graph) -> int:
    count = 0
    for node in g.each("Transpose"):
        if node.outputs[0].is_graph_output():
            continue
        w = weight(g, node.inputs[0])
        if w is None:
            continue
        perm = list(attr(node, "perm", None) or reversed(range(w.q.ndim)))
        per_axis = w.scale.size != 1
        if per_axis and w.scale.ndim != 1:
            continue  # blocked quantization: not a layout this pass moves
        replace_moved_weight(g, node, w, np.transpose(w.q, perm), perm.index(w.axis) if per_axis else None, "_t")
        count += 1
    return count
