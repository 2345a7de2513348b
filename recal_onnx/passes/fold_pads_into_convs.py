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

from ..ir_edits import Graph, Node, attr, input_of, set_attr


def _zero_pad(g: Graph, pad: Node, rank: int) -> list[int] | None:
    """The Pad's pads as ``[begin..., end...]`` over all ``rank`` axes, when it pads zeros in constant mode."""
    mode = attr(pad, "mode", b"constant")
    if (mode.decode() if isinstance(mode, bytes) else mode) != "constant":
        return None
    if input_of(pad, 2) is not None:
        value = g.const(pad.inputs[2])
        if value is None or np.any(value != 0):
            return None
    if len(pad.inputs) < 2:  # opset < 11: pads and value are attributes
        pads, value = attr(pad, "pads"), attr(pad, "value", 0.0)
        return list(pads) if pads is not None and value == 0 and len(pads) == 2 * rank else None
    pads = g.const(pad.inputs[1])
    if pads is None:
        return None
    pads = [int(p) for p in pads.reshape(-1)]
    if input_of(pad, 3) is not None:  # opset 18: the axes padded
        axes = g.const(pad.inputs[3])
        if axes is None:
            return None
        full = [0] * (2 * rank)
        for i, axis in enumerate(int(a) % rank for a in axes.reshape(-1)):
            full[axis], full[axis + rank] = pads[i], pads[i + len(axes.reshape(-1))]
        pads = full
    return pads if len(pads) == 2 * rank else None


def fold_pads_into_convs(g: Graph) -> int:
    count = 0
    for conv in g.each("Conv"):
        pad = g.producer(conv.inputs[0])
        if pad is None:
            continue
        rank = g.rank(conv.inputs[0])
        auto_pad = attr(conv, "auto_pad", b"NOTSET")
        auto_pad = auto_pad.decode() if isinstance(auto_pad, bytes) else auto_pad
        if pad.op_type != "Pad" or rank is None or g.uses(pad.outputs[0]) != 1 or auto_pad not in ("NOTSET", "VALID"):
            continue  # (VALID is no padding: padding="valid", as Hugging Face's depthwise conv writes it)
        pads = _zero_pad(g, pad, rank)
        if pads is None or min(pads) < 0 or any(pads[i] or pads[i + rank] for i in (0, 1)):
            continue  # a negative pad crops; the batch and channel axes are no conv padding
        spatial = rank - 2
        old = attr(conv, "pads") or [0] * (2 * spatial)
        new = [old[i] + pads[2 + i] for i in range(spatial)] + [old[spatial + i] + pads[rank + 2 + i]
                                                                  for i in range(spatial)]
        conv.attributes.pop("auto_pad", None)
        set_attr(conv, "pads", new)
        conv.replace_input_with(0, pad.inputs[0])
        g.remove(pad)
        count += 1
    return count
