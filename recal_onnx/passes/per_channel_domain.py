"""Before opset 13, a QuantizeLinear / DequantizeLinear the passes made per channel is onnxruntime's own.

A file at opset 11 or 12 (paddle2onnx exports PaddleOCR's models so, and NNCF and ModelOpt keep the opset) gets
per-channel scales from the passes: a BatchNorm become a depthwise conv, an affine folded into a weight's scales, a
pruned channel's scale. The default domain's QuantizeLinear takes an ``axis`` only from opset 13, so the converted
model would not load; onnxruntime's ``com.microsoft`` QuantizeLinear / DequantizeLinear take one at any opset and
compute the same.

Before::  DequantizeLinear(w, s[C], axis=0)                   (opset 11: not a valid model)
After::   com.microsoft.DequantizeLinear(w, s[C], axis=0)
"""

from __future__ import annotations

from ..ir_edits import MS_DOMAIN, Graph

PER_CHANNEL_OPSET = 13  # the default domain's QuantizeLinear / DequantizeLinear take an axis from this opset


def per_channel_domain(g: Graph) -> int:
    if g.opset >= PER_CHANNEL_OPSET:
        return 0
    moved = [n for n in g.nodes if n.domain in ("", "ai.onnx") and n.op_type in ("QuantizeLinear", "DequantizeLinear")
             and "axis" in n.attributes]
    for node in moved:
        node.domain = MS_DOMAIN
    return len(moved)
