"""A layer left float with float weights reads its quantized input through a dequantization of its own, so that
onnxruntime keeps its weights as the file holds them.

A default onnxruntime session quantizes the float weight of any Conv / ConvTranspose / Gemm whose input is a
``DequantizeLinear`` with one scale, to one per-tensor int8 step of its own choosing (and a float bias to int32:
its ``WeightBiasQuantization`` transformer, level 1). For a layer the converter leaves float (a weight on no int8
grid: a mixed-precision export's float layer) that changes the model: measured on a 3x3 conv, 11% of the next
quantized tensor's values moved, by up to 2 steps, and verification refused the result. The same dequantization
written per channel (one scale repeated along the channels the layer reads) means the same numbers, value for value,
and is not what that transformer matches.

Before::  DQ(x_q, s, zp) -> Conv(x, W_float, b_float)
After::   DQ(x_q, [s] * C, [zp] * C, axis=1) -> Conv(x, W_float, b_float)      (read by this layer only)

A layer with a dequantized weight stays as it is: the transformer at most rounds its float bias to int32 steps of
input scale x weight scale (half a step at most, as the converter itself rounds such biases), and reading the input
per channel costs ~0.5% (a small ResNet's float convs, AMD EPYC).
"""

from __future__ import annotations

import numpy as np

from ..ir_edits import Graph, Node, attr, input_of

TOUCHED = ("Conv", "ConvTranspose", "Gemm")  # what onnxruntime's WeightBiasQuantization rewrites


def shield_float_weights(g: Graph) -> int:
    count = 0
    for node in g.each(*TOUCHED):
        dq, w = g.producer(input_of(node, 0)), g.const(input_of(node, 1))
        if dq is None or dq.op_type != "DequantizeLinear" or not _one_scale(g, dq):
            continue
        if w is None or w.dtype != np.float32:
            continue  # a dequantized weight (None here): onnxruntime at most rounds a float bias to int32
        channels, axis = _input_channels(node, w)
        scale = g.const(input_of(dq, 1)).reshape(())
        zero_point = input_of(dq, 2)
        zp = g.const(zero_point).reshape(()) if zero_point is not None else np.zeros((), np.uint8)
        scales = g.add_const(f"{node.name}_input_scale", np.full(channels, scale))
        zps = g.add_const(f"{node.name}_input_zp", np.full(channels, zp))
        own = g.add_node("DequantizeLinear", [dq.inputs[0], scales, zps], name=f"{node.name or node.op_type}_input_dq",
                         axis=axis)
        node.replace_input_with(0, own.outputs[0])
        count += 1
    return count


def _one_scale(g: Graph, dq: Node) -> bool:
    """What onnxruntime's rewrite matches: one constant scale, a constant zero point or none (``qdq.activation``
    asks for a zero point, which opset 21 exporters may leave out)."""
    scale, zero_point = g.const(input_of(dq, 1)), input_of(dq, 2)
    return scale is not None and scale.size == 1 and (zero_point is None or g.is_const(zero_point))


def _input_channels(node: Node, w: np.ndarray) -> tuple[int, int]:
    """How many channels the layer's input has, and along which axis."""
    if node.op_type == "Conv":
        return w.shape[1] * attr(node, "group", 1), 1
    if node.op_type == "ConvTranspose":
        return w.shape[0], 1
    k = w.shape[1] if attr(node, "transB", 0) else w.shape[0]
    return k, 0 if attr(node, "transA", 0) else 1
