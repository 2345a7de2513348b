"""An int8 embedding table is looked up in int8: ``DQ(table) -> Gather`` becomes ``Gather -> dequantize``.

As exported, the runtime dequantizes the whole table (vocabulary x hidden) on every run to read a few rows;
gathering the integer rows first reads only those rows, and the file keeps the table in int8.

Before::  table_int8 [V, D] -> DequantizeLinear(s) -> Gather(ids, axis=0)
After::   per tensor / per column:  Gather(table_int8, ids) -> DequantizeLinear(s, axis=-1)
          per row (s [V]):          Gather(table_int8, ids) -> Cast(float) -> Mul(Gather(s [V, 1], ids))
"""

from __future__ import annotations

import numpy as np
from onnx import TensorProto

from ..graph import Graph, attr
from ..qdq import weight


def gather_int8_tables(g: Graph) -> int:
    count = 0
    for node in list(g.nodes):
        if node.op_type != "Gather" or attr(node, "axis", 0) != 0:
            continue
        w = weight(g, node.input[0])
        if w is None or w.q.ndim != 2 or w.q.dtype not in (np.int8, np.uint8):
            continue
        dq, ids, out = w.dq, node.input[1], node.output[0]
        rows = g.add_node("Gather", [dq.input[0], ids], [g.fresh(out + "_int8")], name=(node.name or "gather")
                          + "_int8", axis=0)
        if w.scale.size == 1 or w.axis == 1:
            zp = list(dq.input[2:3])
            g.add_node("DequantizeLinear", [rows.output[0], dq.input[1], *zp], [out], name=rows.name + "_dq",
                       **({"axis": -1} if w.scale.size != 1 else {}))
        else:  # per-row scales: each looked-up row takes its own scale (and zero point)
            values = g.add_node("Cast", [rows.output[0]], [g.fresh(out + "_f32")], to=TensorProto.FLOAT).output[0]
            if np.any(w.zero_point != 0):
                zps = g.add_const(dq.input[2] + "_rows", w.zero_point.reshape(-1, 1).astype(np.float32))
                zp_rows = g.add_node("Gather", [zps, ids], [g.fresh(out + "_zp")], axis=0).output[0]
                values = g.add_node("Sub", [values, zp_rows], [g.fresh(out + "_centred")]).output[0]
            scales = g.add_const(dq.input[1] + "_rows", w.scale.reshape(-1, 1).astype(np.float32))
            scale_rows = g.add_node("Gather", [scales, ids], [g.fresh(out + "_scale")], axis=0).output[0]
            g.add_node("Mul", [values, scale_rows], [out], name=rows.name + "_scaled")
        g.remove(node)
        if not g.uses(dq.output[0]):
            g.remove(dq)
        count += 1
    return count
