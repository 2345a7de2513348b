"""QDQ output: a float bias of a quantized Conv/Gemm (or MatMul + Add) becomes ``DQ(int32, s_x * s_w)``,
as runtimes expect.

Before::  DQ(x), DQ(w) -> Conv(bias: float)
After::   DQ(x), DQ(w) -> Conv(bias: DequantizeLinear(round(bias / (s_x * s_w)), s_x * s_w, 0, axis=0))

A Linear on 3-D inputs is ``MatMul -> Add(bias)``: with a float bias onnxruntime first fuses the two into a
float Gemm (static shapes) and the weight's DequantizeLinear stays, a float matmul; with the int32 bias it
becomes QGemm (static shapes) or MatMulIntegerToFloat (dynamic ones).
"""

from __future__ import annotations

import numpy as np

from ..findings import Findings
from ..ir_edits import Graph, input_of
from ..qdq import activation, scalar, weight
from ..quantized_ops import quantized_bias


def bias_to_int32(g: Graph, findings: Findings | None = None) -> int:
    findings = Findings() if findings is None else findings
    count = 0
    for node in list(g.nodes):
        if node.op_type == "MatMul":
            add = g.only_consumer(node.outputs[0])
            if add is None or add.op_type != "Add":
                continue
            index = 1 if add.inputs[0] is node.outputs[0] else 0
            node, matmul = add, node  # the bias is the Add's
            bias = g.const(add.inputs[index])
            if bias is None or bias.ndim != 1:
                continue
        elif node.op_type in ("Conv", "Gemm") and g.is_const(input_of(node, 2)):
            index, matmul = 2, node
        else:
            continue
        x, w = activation(g, matmul.inputs[0]), weight(g, matmul.inputs[1])
        if x is None or w is None or (matmul is not node and (w.q.ndim != 2 or w.q.shape[1] != bias.size)):
            continue
        q_bias = quantized_bias(g, node, x, w, index, findings)
        if q_bias is None:
            continue  # int32 cannot hold it: the float bias stays, and onnxruntime runs this layer in float
        scale = (scalar(g, x.scale) * w.scale.astype(np.float64).reshape(-1)).astype(np.float32)
        bias_name = node.inputs[index].name
        scale_const = g.add_const(bias_name + "_scale", scale if scale.size > 1 else scale.reshape(()))
        # no zero point: it is 0 and int32 (DQ's default), no array of zeros
        dq = g.add_node("DequantizeLinear", [q_bias, scale_const], name=node.name + "_bias_dq",
                        **({"axis": 0} if scale.size > 1 else {}))
        node.replace_input_with(index, dq.outputs[0])
        count += 1
    return count

