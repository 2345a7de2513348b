"""Activation Q/DQ nodes get scalar scales and zero points.

Before::  x -> QuantizeLinear(s: [1], zp: [1])
After::   x -> QuantizeLinear(s: (), zp: ())
"""

from __future__ import annotations

from ..ir_edits import Graph


def scalar_activation_qparams(g: Graph) -> int:
    """Give activation Q/DQ nodes scalar scale and zero point (``[1]``-shaped ones, as ``torch.ao``
    exports them, break onnxruntime's fused QLinear ops at type inference)."""
    count = 0
    for node in g.each("QuantizeLinear", "DequantizeLinear"):
        if len(node.inputs) < 3:
            continue
        if node.op_type == "DequantizeLinear" and g.is_const(node.inputs[0]):
            continue  # a weight: per-channel parameters stay as they are
        for i in (1, 2):
            value = g.const(node.inputs[i])
            if value is not None and value.size == 1 and value.ndim > 0:
                node.replace_input_with(i, g.add_const(node.inputs[i].name + "_scalar", value.reshape(())))
                count += 1
    return count
