"""A zero pad before a conv becomes the conv's own padding.

Before::  x -> Pad(pads, mode=constant, value=0) -> Conv(pads=p)
After::   x -> Conv(pads=p + the Pad's spatial pads)

Hugging Face's TF-style "same" padding (MobileNet, EfficientNet) and ``nn.ZeroPad2d`` write an explicit Pad.
Between a DequantizeLinear and a conv it would stay a float op and keep the conv float; folded, the conv reads
the dequantized input directly and quantizes (a quantized conv pads with the input's zero point, which is the
real 0). Exact in any format: padding by zeros is what the conv does itself.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper

from ..graph import Graph, attr


def _zero_pad(g: Graph, pad: onnx.NodeProto, rank: int) -> list[int] | None:
    """The Pad's pads as ``[begin..., end...]`` over all ``rank`` axes, when it pads zeros in constant mode."""
    mode = attr(pad, "mode", b"constant")
    if (mode.decode() if isinstance(mode, bytes) else mode) != "constant":
        return None
    if len(pad.input) > 2 and pad.input[2]:
        value = g.const(pad.input[2])
        if value is None or np.any(value != 0):
            return None
    if len(pad.input) < 2:  # opset < 11: pads and value are attributes
        pads, value = attr(pad, "pads"), attr(pad, "value", 0.0)
        return list(pads) if pads is not None and value == 0 and len(pads) == 2 * rank else None
    pads = g.const(pad.input[1])
    if pads is None:
        return None
    pads = [int(p) for p in pads.reshape(-1)]
    if len(pad.input) > 3 and pad.input[3]:  # opset 18: the axes padded
        axes = g.const(pad.input[3])
        if axes is None:
            return None
        full = [0] * (2 * rank)
        for i, axis in enumerate(int(a) % rank for a in axes.reshape(-1)):
            full[axis], full[axis + rank] = pads[i], pads[i + len(axes.reshape(-1))]
        pads = full
    return pads if len(pads) == 2 * rank else None


def fold_pads_into_convs(g: Graph) -> int:
    count = 0
    for conv in list(g.nodes):
        if conv.op_type != "Conv" or conv.input[0] not in g.producer:
            continue
        pad = g.producer[conv.input[0]]
        rank = g.ranks.get(conv.input[0])
        auto_pad = attr(conv, "auto_pad", b"NOTSET")
        auto_pad = auto_pad.decode() if isinstance(auto_pad, bytes) else auto_pad
        if pad.op_type != "Pad" or rank is None or g.uses(pad.output[0]) != 1 or auto_pad not in ("NOTSET", "VALID"):
            continue  # (VALID is no padding: padding="valid", as Hugging Face's depthwise conv writes it)
        pads = _zero_pad(g, pad, rank)
        if pads is None or min(pads) < 0 or any(pads[i] or pads[i + rank] for i in (0, 1)):
            continue  # a negative pad crops; the batch and channel axes are no conv padding
        spatial = rank - 2
        old = attr(conv, "pads") or [0] * (2 * spatial)
        new = [old[i] + pads[2 + i] for i in range(spatial)] + [old[spatial + i] + pads[rank + 2 + i]
                                                                  for i in range(spatial)]
        for a in list(conv.attribute):
            if a.name in ("pads", "auto_pad"):
                conv.attribute.remove(a)
        conv.attribute.append(helper.make_attribute("pads", new))
        conv.input[0] = pad.input[0]
        g.remove(pad)
        count += 1
    return count
