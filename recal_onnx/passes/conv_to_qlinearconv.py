"""Quantized convolutions: QLinearConv with an int32 bias.

Before::  DQ(q_x, s_x, zp_x), DQ(w_int8, s_w, 0) -> Conv(bias) -> [Relu] -> QuantizeLinear(s_y, zp_y) -> q_y
After::   q_x, w_int8 -> QLinearConv(s_x, zp_x, s_w, 0, s_y, zp_y, round(bias / (s_x * s_w))) -> [Max(., zp_y)] -> q_y

A ReLU costs nothing when ``zp_y`` is the lowest integer (the output clamp is the ReLU); otherwise
it becomes ``Max(q, zp_y)`` on the integers.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper

from ..graph import Graph
from ..qdq import QTensor, QWeight, activation, quantize_node_of, scalar, weight

CONV_ATTRS = ("auto_pad", "dilations", "group", "kernel_shape", "pads", "strides")


def quantized_bias(g: Graph, node: onnx.NodeProto, x: QTensor, w: QWeight, index: int) -> str | None:
    """The int32 bias ``round(bias / (s_x * s_w))`` for ``node.input[index]``; '' when there is none."""
    if len(node.input) <= index or not node.input[index]:
        return ""
    bias = g.const(node.input[index])
    if bias is None:
        return None
    scale = scalar(g, x.scale) * w.scale.astype(np.float64).reshape(-1)
    values = np.round(np.asarray(bias, np.float64).reshape(-1) / scale)
    info = np.iinfo(np.int32)
    return g.add_const(node.input[index] + "_int32", np.clip(values, info.min, info.max).astype(np.int32))


def output_tail(g: Graph, name: str) -> tuple[onnx.NodeProto | None, onnx.NodeProto | None]:
    """``(relu, quantize)`` after ``name``: an optional Relu, then the QuantizeLinear that reads it."""
    relu = g.only_consumer(name)
    if relu is not None and relu.op_type == "Relu":
        return relu, quantize_node_of(g, relu.output[0])
    return None, quantize_node_of(g, name)


def integer_output(g: Graph, relu: onnx.NodeProto | None, q: onnx.NodeProto) -> str:
    """Where the quantized op writes: ``q``'s output, or a temporary that :func:`add_integer_relu` clamps."""
    if relu is None or relu_is_free(g, q):
        return q.output[0]
    return g.fresh(q.output[0] + "_prerelu")


def add_integer_relu(g: Graph, relu: onnx.NodeProto | None, q: onnx.NodeProto, raw: str) -> None:
    if raw != q.output[0]:
        g.add_node("Max", [raw, q.input[2]], [q.output[0]], name=relu.name + "_int8")


def relu_is_free(g: Graph, q: onnx.NodeProto) -> bool:
    """A ReLU before ``q`` is implied by the output clamp when ``q``'s zero point is the lowest integer."""
    zp = g.const(q.input[2])
    return int(zp.reshape(-1)[0]) == np.iinfo(zp.dtype).min


def weight_inputs(g: Graph, w: QWeight, channels_axis: int) -> tuple[str, str, str] | None:
    """(q, scale, zero point) names for an int8 symmetric weight, per tensor or per output channel."""
    if w.q.dtype != np.int8 or np.any(w.zero_point != 0):
        return None
    if w.scale.size != 1 and (w.axis != channels_axis or w.scale.size != w.q.shape[channels_axis]):
        return None
    scale = w.scale.reshape(-1) if w.scale.size != 1 else w.scale.reshape(())
    return (w.dq.input[0], g.add_const(w.dq.input[1] + "_w", scale.astype(np.float32)),
            g.add_const("w_zero_point", np.zeros(scale.shape, np.int8)))


def conv_to_qlinearconv(g: Graph) -> int:
    count = 0
    for node in list(g.nodes):
        if node.op_type != "Conv" or node not in g.nodes:
            continue
        x, w = activation(g, node.input[0]), weight(g, node.input[1])
        if x is None or w is None:
            continue
        relu, q = output_tail(g, node.output[0])
        w_inputs = weight_inputs(g, w, 0)
        bias = quantized_bias(g, node, x, w, 2)
        if q is None or w_inputs is None or bias is None:
            continue
        raw = integer_output(g, relu, q)
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute if a.name in CONV_ATTRS}
        inputs = [x.q, x.scale, x.zero_point, *w_inputs, q.input[1], q.input[2]] + ([bias] if bias else [])
        g.remove(*(n for n in (node, relu, q) if n is not None))
        g.add_node("QLinearConv", inputs, [raw], name=node.name + "_quant", **attrs)
        add_integer_relu(g, relu, q, raw)
        count += 1
    return count
