"""Quantized convolutions: QLinearConv with an int32 bias.

Before::  DQ(q_x, s_x, zp_x), DQ(w_int8, s_w, 0) -> Conv(bias) -> [Relu] -> QuantizeLinear(s_y, zp_y) -> q_y
After::   q_x, w_int8 -> QLinearConv(s_x, zp_x, s_w, 0, s_y, zp_y, round(bias / (s_x * s_w))) -> [Max(., zp_y)] -> q_y

A ReLU costs nothing when ``zp_y`` is the lowest integer (the output clamp is the ReLU); otherwise
it becomes ``Max(q, zp_y)`` on the integers.
"""

from __future__ import annotations

from ..findings import Findings
from ..ir_edits import Graph
from ..qdq import activation, weight
from ..quantized_ops import output_tail, quantized_bias, replace_with_quantized, weight_inputs

CONV_ATTRS = ("auto_pad", "dilations", "group", "kernel_shape", "pads", "strides")


def conv_to_qlinearconv(g: Graph, findings: Findings | None = None) -> int:
    findings = Findings() if findings is None else findings
    count = 0
    for node in g.each("Conv"):
        x, w = activation(g, node.inputs[0]), weight(g, node.inputs[1])
        if x is None or w is None:
            continue
        relu, q = output_tail(g, node.outputs[0])
        w_inputs = weight_inputs(g, w, 0)
        if q is None or w_inputs is None:
            continue
        bias = quantized_bias(g, node, x, w, 2, findings, q)
        if bias is None:
            continue
        attrs = {k: a for k, a in node.attributes.items() if k in CONV_ATTRS}
        inputs = [x.q, x.scale, x.zero_point, *w_inputs, q.inputs[1], q.inputs[2]]
        inputs += [bias] if bias is not False else []
        replace_with_quantized(g, [node], relu, q, "QLinearConv", inputs, name=node.name + "_quant", **attrs)
        count += 1
    return count
