"""QDQ output: a float bias of a quantized Conv/Gemm becomes ``DQ(int32, s_x * s_w)``, as runtimes expect.

Before::  DQ(x), DQ(w) -> Conv(bias: float)
After::   DQ(x), DQ(w) -> Conv(bias: DequantizeLinear(round(bias / (s_x * s_w)), s_x * s_w, 0, axis=0))
"""

from __future__ import annotations

import numpy as np

from ..graph import Graph
from ..qdq import activation, scalar, weight
from ..quantized_ops import quantized_bias


def bias_to_int32(g: Graph) -> int:
    count = 0
    for node in list(g.nodes):
        if node.op_type not in ("Conv", "Gemm") or len(node.input) < 3 or not g.is_const(node.input[2]):
            continue
        x, w = activation(g, node.input[0]), weight(g, node.input[1])
        if x is None or w is None:
            continue
        q_bias = quantized_bias(g, node, x, w, 2)
        scale = (scalar(g, x.scale) * w.scale.astype(np.float64).reshape(-1)).astype(np.float32)
        scale_name = g.add_const(node.input[2] + "_scale", scale if scale.size > 1 else scale.reshape(()))
        zp_name = g.add_const(node.input[2] + "_zp", np.zeros(scale.shape if scale.size > 1 else (), np.int32))
        out = g.fresh(node.input[2] + "_dq")
        g.add_node("DequantizeLinear", [q_bias, scale_name, zp_name], [out], name=node.name + "_bias_dq",
                   **({"axis": 0} if scale.size > 1 else {}))
        node.input[2] = out
        g.refresh()
        count += 1
    return count

