"""Weights written in 4 bits, or in blocks, as the forms the layer passes read: the same values.

A 4-bit weight (opset 21 ``int4`` / ``uint4``, or onnxruntime's ``com.microsoft`` DequantizeLinear, as
``quantize_static(weight_type=QInt4)`` writes it) holds integers that int8 holds exactly: it becomes int8 (uint8 for
``uint4``, zero point and all), which the integer kernels take. Its values lie within +-8, so a CPU without VNNI
computes it exactly too (no 16-bit pair saturates).

Before::  q4 -> DequantizeLinear(s, zp4[, axis])
After::   q8 -> DequantizeLinear(s, zp8[, axis])

A weight quantized in blocks along its input axis (opset 21 ``block_size``: onnxruntime's ``MatMulNBitsQuantizer``
in QDQ form, ModelOpt's INT4 export) read only as a MatMul's weight is the grouped weight recal's weight-only export
writes: one row a group, zero point subtracted, which :mod:`~recal_onnx.passes.matmul_to_nbits` makes ``MatMulNBits``.

Before::  q [K, N] -> DequantizeLinear(s [K/B, N], zp, axis=0, block_size=B) -> MatMul(x, .)
After::   q - zp as int8 [N*K/B, B] -> DequantizeLinear(s [N*K/B], axis=0) -> Reshape [N, K] -> Transpose -> MatMul

A weight held ``[N, K]`` as torch's Linear holds it (blocks along axis 1), read through a Transpose to a MatMul or by
``Gemm(transB=1)``, becomes the same rows reshaped to ``[N, K]``, read as before.

A blocked weight read anywhere else stays as it is (onnxruntime dequantizes it; the layer stays float, named).
"""

from __future__ import annotations

import numpy as np

from ..ir_edits import Graph, Node, attr, input_of
from ..qdq import without_zero_point

WIDER = {"int4": np.int8, "uint4": np.uint8}


def widen_weights(g: Graph) -> int:
    """Widen every 4-bit constant weight to 8 bits; rewrite every blocked MatMul weight as grouped rows."""
    count = 0
    for node in g.each("DequantizeLinear"):
        if not g.is_const(node.inputs[0]):
            continue
        if attr(node, "block_size", 0):
            count += _blocked_to_rows(g, node)
            continue
        q = g.const(node.inputs[0])
        if q.dtype.name not in WIDER:
            continue
        wide, old = WIDER[q.dtype.name], [node.inputs[0], input_of(node, 2)]
        node.replace_input_with(0, g.add_const(old[0].name + "_8bit", q.astype(wide)))
        if old[1] is not None and g.const(old[1]) is not None:
            node.replace_input_with(2, g.add_const(old[1].name + "_8bit", g.const(old[1]).astype(wide)))
        g.drop_if_unused(*(v for v in old if v is not None))
        count += 1
    return count


def _blocked_to_rows(g: Graph, node: Node) -> int:
    q, scale = g.const(node.inputs[0]), g.const(node.inputs[1])
    zero_point = g.const(input_of(node, 2)) if input_of(node, 2) is not None else np.zeros(scale.shape, np.int8)
    block, axis = attr(node, "block_size"), attr(node, "axis", 1)
    if q is None or scale is None or zero_point is None or q.ndim != 2 or zero_point.shape != scale.shape \
            or node.outputs[0].is_graph_output() or not _read_as_matmul_weight(g, node, axis % 2):
        return 0
    inputs = q.shape[axis % 2]
    if inputs % block or scale.shape[axis % 2] != inputs // block or scale.shape[1 - axis % 2] != q.shape[1 - axis % 2]:
        return 0
    values = without_zero_point(q, np.repeat(zero_point, block, axis=axis % 2))
    if values is None:
        return 0
    if axis % 2 == 0:  # [K, N], blocks along K: as [N, K]
        values, scale = values.T, scale.T
    n, k = values.shape
    rows = np.ascontiguousarray(values.reshape(n * k // block, block))
    base, name = node.inputs[0].name, node.name or "dequantize"
    dq = g.add_node("DequantizeLinear", [g.add_const(base + "_rows", rows),
                                         g.add_const(base + "_row_scales", scale.reshape(-1).astype(np.float32)),
                                         g.add_const(base + "_row_zero_points", np.zeros(n * k // block, np.int8))],
                    name=name + "_rows", axis=0)
    shape = g.add_const(base + "_shape", np.array([n, k], np.int64))
    if axis % 2 == 0:
        reshaped = g.add_node("Reshape", [dq.outputs[0], shape], name=name + "_reshape")
        g.add_node("Transpose", [reshaped.outputs[0]], name=name + "_transpose", perm=[1, 0], replaces=node.outputs[0])
    else:  # [N, K], as torch's Linear holds it: read through a Transpose or by Gemm(transB=1)
        g.add_node("Reshape", [dq.outputs[0], shape], name=name + "_reshape", replaces=node.outputs[0])
    old = [v for v in node.inputs if v is not None]
    g.remove(node)
    g.drop_if_unused(*old)
    return 1


def _read_as_matmul_weight(g: Graph, node: Node, axis: int) -> bool:
    """Whether every reader takes the weight as a MatMul's ``[K, N]`` (``axis`` 0: blocks along its inputs), or as
    ``[N, K]`` (``axis`` 1) through a Transpose to a MatMul or by ``Gemm(transB=1)``."""
    readers = g.consumers(node.outputs[0])
    if not readers:
        return False
    if axis == 0:
        return all(r.op_type == "MatMul" and input_of(r, 1) is node.outputs[0] for r in readers)
    for r in readers:
        if r.op_type == "Gemm" and input_of(r, 1) is node.outputs[0] and attr(r, "transB", 0):
            continue
        if r.op_type == "Transpose" and list(attr(r, "perm", [1, 0])) == [1, 0] and g.consumers(r.outputs[0]) and all(
                m.op_type == "MatMul" and input_of(m, 1) is r.outputs[0] for m in g.consumers(r.outputs[0])):
            continue
        return False
    return True
