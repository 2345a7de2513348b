"""Constant weights with a zero point become symmetric int8, the same values: what the integer kernels take.

``quantize_static(weight_type=QUInt8)``, recal's own ``format="qdq"`` output for AVX2 CPUs (uint8, zero point 128)
and asymmetric weight quantizers write ``DequantizeLinear(w_uint8, s, zp)``. Where every ``w - zp`` fits int8 the
weight means exactly ``DequantizeLinear(w - zp, s, 0)``; the later passes then treat it as any int8 weight (and
:mod:`~recal_onnx.passes.uint8_weights` stores it back as uint8 where the target needs that).

Before::  DequantizeLinear(w_uint8, s, zp)         -> Conv
After::   DequantizeLinear((w - zp) as int8, s, 0) -> Conv

A weight whose values minus its zero point leave int8 (an asymmetric 8-bit range, ``quantize_static``'s
``WeightSymmetric=False``) keeps a zero point, one for the whole weight, which the integer kernels subtract
themselves: int8 as it is, uint8 moved to int8 with its zero point (``w - 128``, ``zp - 128``: the same values).
Zero points that differ between channels stay as they are, and the layer stays float with that reason
(:mod:`recal_onnx.float_reasons`).

Before::  DequantizeLinear(w_uint8, s, 10)               (255 - 10 leaves int8)
After::   DequantizeLinear((w - 128) as int8, s, -118)
"""

from __future__ import annotations

import numpy as np

from ..ir_edits import Graph, input_of, set_input
from ..qdq import along_axis, without_zero_point


def weights_to_int8(g: Graph) -> int:
    count = 0
    for node in g.each("DequantizeLinear"):
        q, zero_point = g.const(node.inputs[0]), input_of(node, 2)
        zp = g.const(zero_point)
        if q is None or zp is None or q.dtype not in (np.uint8, np.int8) or not g.is_const(input_of(node, 1)):
            continue
        if q.dtype == np.int8 and not np.any(zp):
            continue  # already symmetric int8
        shaped = along_axis(node, q, zp)
        if shaped is None:
            continue
        zp_b, = shaped
        shifted = without_zero_point(q, zp_b)
        if shifted is None:
            if q.dtype != np.uint8 or np.unique(zp).size != 1:
                continue  # int8 keeps its zero point as it is; zero points that differ by channel: float
            shifted, zp = q.astype(np.int16) - 128, zp.astype(np.int16) - 128  # one zero point, moved with it
        else:
            zp = np.zeros(zp.shape, np.int8)
        node.replace_input_with(0, g.add_const(node.inputs[0].name + "_s8", shifted.astype(np.int8)))
        set_input(node, 2, g.add_const(zero_point.name + "_s8", zp.astype(np.int8)))
        count += 1
    return count
