"""Average pooling on quantized tensors: QLinearGlobalAveragePool / QLinearAveragePool (com.microsoft).

Before::  q -> DequantizeLinear(s, zp) -> GlobalAveragePool -> QuantizeLinear(s2, zp2) -> q2
After::   q -> QLinearGlobalAveragePool(s, zp, s2, zp2) -> q2

A ReduceMean over the spatial axes of an NCHW tensor (keepdims=1), as the dynamo exporter writes
``adaptive_avg_pool2d(x, 1)``, is a global average pool.
"""

from __future__ import annotations

import onnx
from onnx import helper

from ..graph import MS_DOMAIN, Graph, attr
from ..qdq import QTensor, activation, quantize_node_of

AVERAGE_POOL_ATTRS = ("auto_pad", "ceil_mode", "count_include_pad", "kernel_shape", "pads", "strides")


def average_pool_kind(g: Graph, node: onnx.NodeProto) -> str | None:
    if node.op_type == "GlobalAveragePool":
        return "global"
    if node.op_type == "AveragePool" and not attr(node, "dilations"):
        return "average"
    if node.op_type == "ReduceMean" and attr(node, "keepdims", 1) == 1 and g.ranks.get(node.input[0]) == 4:
        axes = attr(node, "axes")
        if axes is None and len(node.input) > 1 and node.input[1]:
            value = g.const(node.input[1])
            axes = None if value is None else value.reshape(-1).tolist()
        if axes is not None and sorted(a % 4 for a in axes) == [2, 3]:
            return "global"
    return None


def make_qlinear_pool(g: Graph, node: onnx.NodeProto, x: QTensor, y_scale: str, y_zero_point: str,
                      output: str) -> onnx.NodeProto:
    inputs = [x.q, x.scale, x.zero_point, y_scale, y_zero_point]
    if average_pool_kind(g, node) == "global":
        return g.add_node("QLinearGlobalAveragePool", inputs, [output], name=node.name + "_quant",
                          domain=MS_DOMAIN, channels_last=0)
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute if a.name in AVERAGE_POOL_ATTRS}
    return g.add_node("QLinearAveragePool", inputs, [output], name=node.name + "_quant", domain=MS_DOMAIN, **attrs)


def pool_to_qlinear(g: Graph) -> int:
    count = 0
    for node in list(g.nodes):
        if node not in g.nodes or not node.input or average_pool_kind(g, node) is None:
            continue
        x = activation(g, node.input[0])
        q = quantize_node_of(g, node.output[0])
        if x is None or q is None:
            continue
        make_qlinear_pool(g, node, x, q.input[1], q.input[2], q.output[0])
        g.remove(node, q)
        count += 1
    return count
