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

from ..ir_edits import Graph, attr
from ..qdq import weight


def gather_int8_tables(g: Graph) -> int:
    count = 0
    for node in g.each("Gather"):
        if attr(node, "axis", 0) != 0:
            continue
        w = weight(g, node.inputs[0])
        if w is None or w.q.ndim != 2 or w.q.dtype not in (np.int8, np.uint8):
            continue
        dq, ids, out = w.dq, node.inputs[1], node.outputs[0]
        rows = g.add_node("Gather", [dq.inputs[0], ids], name=(node.name or "gather") + "_int8", axis=0)
        if w.scale.size == 1 or w.axis == 1:
            g.add_node("DequantizeLinear", [rows.outputs[0], *dq.inputs[1:3]], name=rows.name + "_dq", replaces=out,
                       **({"axis": -1} if w.scale.size != 1 else {}))
        else:  # per-row scales: each looked-up row takes its own scale (and zero point)
            values = g.add_node("Cast", [rows.outputs[0]], to=TensorProto.FLOAT).outputs[0]
            if np.any(w.zero_point != 0):
                zps = g.add_const(dq.inputs[2].name + "_rows", w.zero_point.reshape(-1, 1).astype(np.float32))
                zp_rows = g.add_node("Gather", [zps, ids], axis=0).outputs[0]
                values = g.add_node("Sub", [values, zp_rows]).outputs[0]
            scales = g.add_const(dq.inputs[1].name + "_rows", w.scale.reshape(-1, 1).astype(np.float32))
            scale_rows = g.add_node("Gather", [scales, ids], axis=0).outputs[0]
            g.add_node("Mul", [values, scale_rows], name=rows.name + "_scaled", replaces=out)
        g.remove(node)
        if not g.uses(dq.outputs[0]):
            g.remove(dq)
        count += 1
    return count
