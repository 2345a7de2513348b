"""Quantized dense layers: Gemm (and 2-D MatMul + bias) become QGemm; other MatMuls MatMulIntegerToFloat.

Before::  DQ(q_a, s_a, zp_a), DQ(w_int8, s_w, 0) -> Gemm(bias) -> [Relu] -> QuantizeLinear(s_y, zp_y) -> q_y
After::   q_a, w_int8 -> QGemm(s_a, zp_a, s_w, 0, int32 bias, s_y, zp_y) -> [Max(., zp_y)] -> q_y

Without a QuantizeLinear after it, QGemm returns float (a model's logits). A MatMul whose input is not 2-D
(a transformer's ``[batch, tokens, hidden]``) is flattened to ``[-1, hidden]`` around the QGemm and reshaped back
(what onnxruntime's own QDQ fusion does): one GEMM with the bias and the requantization inside, where
``MatMulIntegerToFloat`` + ``Add`` + ``QuantizeLinear`` wrote float and read it again (Swin-tiny with quantized
attention, VNNI/AMX Xeon: recal's file was 1.09x slower than its QDQ form run by onnxruntime, now 1.00x). A bias
written first, ``Add(bias, MatMul)``, is the same bias. A MatMul of two quantized activations (attention's Q·Kᵀ
and P·V) becomes QLinearMatMul where a QuantizeLinear alone reads its output, MatMulIntegerToFloat otherwise.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from ..findings import Findings
from ..ir_edits import MS_DOMAIN, Graph, Node, attr
from ..qdq import activation, weight
from ..quantized_ops import (bias_steps, on_grid, output_tail, quantized_bias, replace_with_quantized,
                             weight_inputs)


def gemm_to_qgemm(g: Graph, findings: Findings | None = None) -> int:
    findings = Findings() if findings is None else findings
    count = 0
    for node in g.each("Gemm", "MatMul"):
        if node.op_type == "Gemm":
            count += _gemm(g, node, findings)
        elif node.op_type == "MatMul":
            count += _matmul(g, node, findings)
    return count


def _gemm(g: Graph, node: Node, findings: Findings) -> int:
    if attr(node, "transA", 0) or attr(node, "alpha", 1.0) != 1.0 or attr(node, "beta", 1.0) != 1.0:
        return 0
    a, w = activation(g, node.inputs[0]), weight(g, node.inputs[1])
    if a is None or w is None:
        return 0
    trans_b = attr(node, "transB", 0)
    return _emit_qgemm(g, node, a, w, trans_b, node, 2, findings)


def _matmul(g: Graph, node: Node, findings: Findings) -> int:
    a, w = activation(g, node.inputs[0]), weight(g, node.inputs[1])
    b = activation(g, node.inputs[1]) if w is None else None
    if a is not None and b is not None:  # both operands are activations (attention's Q·Kᵀ and P·V)
        relu, q = output_tail(g, node.outputs[0])
        if q is not None and relu is None:  # its output quantized: the requantization inside the kernel
            replace_with_quantized(g, [node], None, q, "QLinearMatMul", [a.q, a.scale, a.zero_point, b.q, b.scale,
                                                                        b.zero_point, q.inputs[1], q.inputs[2]],
                                   name=node.name + "_quant")
            return 1
        g.add_node("MatMulIntegerToFloat", [a.q, b.q, a.scale, b.scale, a.zero_point, b.zero_point],
                   name=node.name + "_quant", domain=MS_DOMAIN, replaces=node.outputs[0])
        g.remove(node)
        return 1
    if a is None or w is None or w.q.ndim != 2:
        return 0
    add = g.only_consumer(node.outputs[0])
    slot = None  # the Add's input holding the bias: ``Add(MatMul, b)``, or ``Add(b, MatMul)`` as some exporters write
    if add is not None and add.op_type == "Add" and node.outputs[0] in add.inputs:
        slot = 1 if add.inputs[0] is node.outputs[0] else 0
        if not (g.is_const(add.inputs[slot]) and g.const(add.inputs[slot]).size == w.q.shape[1]):
            slot = None
    flatten = g.rank(node.inputs[0]) != 2  # a [batch, tokens, hidden] input: [-1, hidden] around the QGemm
    if flatten and slot is not None and not on_grid(*bias_steps(g, g.const(add.inputs[slot]), a, w)):
        # a float bias between the int32 steps: MatMulIntegerToFloat adds it exactly, where QGemm would round
        return _matmul_integer_to_float(g, node, a, w, add, slot)
    if slot is not None:  # treat MatMul + Add as one Gemm(bias)
        return _emit_qgemm(g, node, a, w, 0, add, slot, findings, extra=[add], flatten=flatten)
    return _emit_qgemm(g, node, a, w, 0, node, None, findings, flatten=flatten)


def _flattened(g: Graph, node: Node, a, k: int, n: int):
    """``a`` with its integers as ``[-1, k]``, and the shape the layer's output takes back (``a``'s, its last
    axis ``n``)."""
    name = node.name or "matmul"
    flat = g.add_node("Reshape", [a.q, g.add_const(name + "_rows", np.array([-1, k], np.int64))],
                      name=name + "_rows").outputs[0]
    shape = g.add_node("Shape", [a.q], name=name + "_shape").outputs[0]
    lead = g.add_node("Slice", [shape, g.add_const(name + "_from", np.array([0], np.int64)),
                                g.add_const(name + "_to", np.array([-1], np.int64))], name=name + "_lead").outputs[0]
    restore = g.add_node("Concat", [lead, g.add_const(name + "_width", np.array([n], np.int64))], axis=0,
                         name=name + "_out_shape").outputs[0]
    return replace(a, q=flat), restore


def _matmul_integer_to_float(g: Graph, node: Node, a, w, add: Node, slot: int) -> int:
    """MatMul + Add(bias in ``add.inputs[slot]``) as MatMulIntegerToFloat with that float bias."""
    w_inputs = weight_inputs(g, w, 1)
    if w_inputs is None:
        return 0
    bias = add.inputs[slot]
    inputs = [a.q, w_inputs[0], a.scale, w_inputs[1], a.zero_point, w_inputs[2],
              g.add_const(bias.name + "_f32", g.const(bias).astype(np.float32).reshape(-1))]
    g.add_node("MatMulIntegerToFloat", inputs, name=node.name + "_quant", domain=MS_DOMAIN, replaces=add.outputs[0])
    g.remove(node, add)
    return 1


def _emit_qgemm(g: Graph, node, a, w, trans_b: int, last, bias_index, findings: Findings, extra=(),
                flatten: bool = False) -> int:
    """QGemm for ``node`` (through ``last``: its bias Add); ``flatten``: its input reshaped to 2-D around it."""
    w_inputs = weight_inputs(g, w, 0 if trans_b else 1)
    if w_inputs is None:
        return 0
    relu, q = output_tail(g, last.outputs[0])
    bias = quantized_bias(g, last, a, w, bias_index, findings, q)
    if bias is None:
        return 0
    restore = None
    if flatten:
        a, restore = _flattened(g, node, a, w.q.shape[0], w.q.shape[1])
    inputs = [a.q, a.scale, a.zero_point, *w_inputs, bias if bias is not False else None]

    def reshaped(out):
        if restore is None:
            return out
        return g.add_node("Reshape", [out, restore], name=node.name + "_unflatten").outputs[0]

    if q is None:  # float output (a model's logits); a ReLU after it stays float
        out = g.add_node("QGemm", inputs, name=node.name + "_quant", domain=MS_DOMAIN, transB=trans_b).outputs[0]
        g.replace(last.outputs[0], reshaped(out), rename=True)
        g.remove(node, *extra)
    else:
        replace_with_quantized(g, [node, *extra], relu, q, "QGemm", [*inputs, q.inputs[1], q.inputs[2]],
                               name=node.name + "_quant", domain=MS_DOMAIN, transB=trans_b, then=reshaped)
    return 1

