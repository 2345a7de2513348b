"""A weight channel that is all zeros (a filter pruned whole) gets the largest scale of the layer's other
channels (1 if none has one): its values stay 0 whatever the scale.

QAT exporters floor the scale of such a channel at a tiny value (max|w| = 0); the int32 bias of the layer,
``round(bias / (s_x * s_w))``, then overflows and is clipped, so the converted channel loses its bias. A scale
like its neighbours' keeps the bias as fine a grid as theirs (with scale 1 the bias of that channel, all its
output is, rounds to steps of ``s_x``: several output steps where ``s_x`` is larger than the output's).

Before::  DequantizeLinear(w_int8, [s_0, 1e-11, s_2, ...], axis=0)   (channel 1 all zeros)
After::   DequantizeLinear(w_int8, [s_0, max(s_0, s_2, ...), s_2, ...], axis=0)
"""

from __future__ import annotations

import numpy as np

from ..graph import Graph
from ..qdq import weight

SCALE_FLOOR = 1e-6  # below it, a zero channel's scale is replaced


def zero_channel_scales(g: Graph) -> int:
    count = 0
    for node in list(g.nodes):
        if node.op_type != "DequantizeLinear":
            continue
        w = weight(g, node.output[0])
        if w is None or w.scale.size < 2 or w.scale.size != w.q.shape[w.axis]:
            continue
        zero = ~np.moveaxis(w.q, w.axis, 0).reshape(w.scale.size, -1).any(axis=1)
        tiny = zero & (w.scale.reshape(-1) < SCALE_FLOOR)
        if not tiny.any():
            continue
        others = w.scale.reshape(-1)[~zero]
        stand_in = float(others.max()) if others.size and others.max() >= SCALE_FLOOR else 1.0
        scale = np.where(tiny, stand_in, w.scale.reshape(-1)).astype(w.scale.dtype).reshape(w.scale.shape)
        node.input[1] = g.add_const(node.input[1] + "_zero_channels", scale)
        g.refresh()
        count += 1
    return count
