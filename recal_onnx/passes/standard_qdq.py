"""onnxruntime's own QuantizeLinear / DequantizeLinear (``com.microsoft``, which ``quantize_static`` writes for 4-bit
and 16-bit types, and for every tensor of such a model) as the default domain's, where the model's opset defines them
for their types: the same arithmetic, and the form the rest of the pipeline folds and verifies.

Before::  com.microsoft.QuantizeLinear(x, s, zp: uint8)
After::   QuantizeLinear(x, s, zp: uint8)                     (8-bit, int32 for a DequantizeLinear; axis from opset 13)
"""

from __future__ import annotations

import numpy as np

from ..ir_edits import MS_DOMAIN, Graph, attr, input_of

STANDARD_TYPES = {np.dtype(np.uint8), np.dtype(np.int8)}


def standard_qdq(g: Graph) -> int:
    count = 0
    for node in g.each("QuantizeLinear", "DequantizeLinear"):
        if node.domain != MS_DOMAIN:
            continue
        zero_point = input_of(node, 2)
        types = {g.const(zero_point).dtype} if zero_point is not None and g.const(zero_point) is not None else set()
        if node.op_type == "DequantizeLinear" and g.is_const(node.inputs[0]):
            types.add(g.const(node.inputs[0]).dtype)
        allowed = STANDARD_TYPES | ({np.dtype(np.int32)} if node.op_type == "DequantizeLinear" else set())
        scale = g.const(input_of(node, 1))
        per_channel = scale is None or scale.size != 1
        if not types or not types <= allowed or attr(node, "block_size", 0) or (per_channel and g.opset < 13):
            continue  # (no zero point and no constant integers: the types are not known here, it stays)
        node.domain = ""
        count += 1
    return count
