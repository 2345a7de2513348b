"""A float layer whose weight is dequantized along an axis other than its output channels reads that weight as the
float constant it means, so that onnxruntime does not fuse it into an integer kernel that refuses it.

The integer kernels take a weight's scales per tensor or per output channel. A weight quantized per input channel
(a QONNX ``Quant`` whose scale has shape ``[1, C_in, 1, 1]``) is left float by the converter, with its reason; but
a default onnxruntime session still fuses ``DQ(x), DQ(w) -> Conv -> Q`` into a ``QLinearConv`` and then fails at
run time ("filter scale shape invalid"): the written model would not run. Dequantized in the file, the weight
holds the same float32 values ``(q - zero_point) * scale`` that ``DequantizeLinear`` computes, and is not what the
fusion matches.

Before::  DQ(w_int8, [s_0, .., s_Cin], axis=1) -> Conv(x, w)
After::   W_float32 = (w_int8 - zp) * s            -> Conv(x, W)      (the same values, bit for bit)
"""

from __future__ import annotations

import numpy as np

from ..findings import Findings
from ..ir_edits import Graph, input_of
from ..qdq import along_axis, output_axis, weight

LAYERS = ("Conv", "ConvTranspose", "Gemm", "MatMul")  # the layers onnxruntime's QDQ fusions make integer


def dequantize_misaligned_weights(g: Graph, findings: Findings) -> int:
    count = 0
    for node in g.each(*LAYERS):
        w = weight(g, input_of(node, 1))
        out_axis = output_axis(node, w.q.ndim) if w is not None else None
        if w is None or w.scale.size == 1 or w.axis == out_axis:
            continue
        params = along_axis(w.dq, w.q, w.scale, w.zero_point)
        if params is None:
            continue
        scale, zero_point = params
        values = ((w.q.astype(np.int32) - zero_point.astype(np.int32)).astype(np.float32) * scale.astype(np.float32))
        node.replace_input_with(1, g.add_const(w.dq.inputs[0].name + "_dequantized", values.astype(np.float32)))
        findings.kept_float[node.name] = (node.op_type, (
            f"its weight's {w.scale.size} scales are along axis {w.axis}, not its output channels (axis {out_axis}), "
            "and integer kernels take them per output channel; the weight is written as the float values it means "
            "(onnxruntime's default session would fuse it into an integer kernel that then fails)"))
        count += 1
    return count

