"""An int4 embedding table is gathered packed: ``Gather(Reshape(DQ(rows)))`` becomes ``GatherBlockQuantized``.

recal's export writes a weight-only table like a weight-only layer (:mod:`recal_onnx.passes.matmul_to_nbits`): rows of
one group each behind a per-row DequantizeLinear, reshaped to ``[vocabulary, width]``. onnxruntime's
``GatherBlockQuantized`` keeps the table packed two values a byte (zero point 8, ``MatMulNBits``' convention) with one
scale per block of a row, and dequantizes only the rows it gathers: half the bytes of an int8 table. A table whose
integers need 8 bits is left to :mod:`recal_onnx.passes.gather_int8_tables`.

Before::  q [V*D/G, G] -> DequantizeLinear(s, axis=0) -> Reshape [V, D] -> Gather(ids, axis=0)
After::   GatherBlockQuantized(packed [V, D/2], ids, s [V, D/G], gather_axis=0, quantize_axis=1, block_size=G, bits=4)

A per-row table (one scale a row) takes the largest power-of-two block (>= 16) that divides its width, the row's
scale repeated in each.
"""

from __future__ import annotations

import numpy as np

from ..ir_edits import MS_DOMAIN, Graph, attr
from .matmul_to_nbits import drop_unread, grouped_weight, pack


def gather_int4_tables(g: Graph) -> int:
    count = 0
    for node in g.each("Gather"):
        if attr(node, "axis", 0) != 0:
            continue
        w = grouped_weight(g, node.inputs[0])
        if w is None or w.q.min() < -8 or w.q.max() > 7:
            continue
        rows, width = w.q.shape
        block = w.group if w.scale.shape[1] > 1 else _row_block(width)
        if block is None or block < 16 or block & (block - 1) or width % block:
            continue
        scale = np.repeat(w.scale, width // block, axis=1) if w.scale.shape[1] == 1 else w.scale
        base = w.nodes[0].inputs[0].name
        packed = g.add_const(base + "_int4", pack(w.q, 4, block).reshape(rows, width // 2))
        scales = g.add_const(base + "_int4_scales", np.ascontiguousarray(scale, np.float32))
        g.add_node("GatherBlockQuantized", [packed, node.inputs[1], scales], name=(node.name or "gather") + "_int4",
                   domain=MS_DOMAIN, replaces=node.outputs[0], gather_axis=0, quantize_axis=1, block_size=block,
                   bits=4)
        g.remove(node)
        drop_unread(g, w)
        count += 1
    return count


def _row_block(width: int) -> int | None:
    block = width & -width  # the largest power of two dividing the width
    return min(block, 256) if block >= 16 else None
