"""Adding or multiplying two quantized tensors: QLinearAdd / QLinearMul (com.microsoft), e.g. a residual connection
or squeeze-excitation's gate (the pooled sigmoid broadcast over the feature map) and a SiLU's ``x * sigmoid(x)``.

Before::  DQ(q_a, s_a, zp_a), DQ(q_b, s_b, zp_b) -> Add | Mul -> [Relu] -> QuantizeLinear(s_y, zp_y) -> q_y
After::   q_a, q_b -> QLinearAdd | QLinearMul(s_a, zp_a, s_b, zp_b, s_y, zp_y) -> [Max(., zp_y)] -> q_y

One operand may be a quantized constant (``DequantizeLinear`` of constant integers, per tensor), as
``quantize_static`` writes a bias added after a MatMul or the scalars of an attention's scale and of a GELU: its
integers are moved to the other operand's type (+-128 with the zero point, the same values) and given its rank.

onnxruntime computes both in float from the integers and rounds once to the output's grid: what the QDQ model
computes. Both operands must have the same rank (the kernels broadcast dimensions of size 1, not missing ones).
"""

from __future__ import annotations

import numpy as np

from ..graph import MS_DOMAIN, Graph, Value
from ..qdq import activation, weight
from ..quantized_ops import output_tail, replace_with_quantized

QUANTIZED = {"Add": "QLinearAdd", "Mul": "QLinearMul"}


def binary_to_qlinear(g: Graph) -> int:
    count = 0
    for node in g.each(*QUANTIZED):
        acts = [activation(g, v) for v in node.inputs[:2]]
        known = [a for a in acts if a is not None]
        if not known:
            continue
        rank, dtype = g.rank(known[0].dq.outputs[0]), g.const(known[0].zero_point).dtype
        operands = [(a.q, a.scale, a.zero_point) if a is not None and g.rank(v) == rank else
                    None if a is not None else _constant_operand(g, v, rank, dtype)
                    for a, v in zip(acts, node.inputs[:2])]
        if rank is None or None in operands or any(g.const(o[2]).dtype != dtype for o in operands):
            continue
        relu, q = output_tail(g, node.outputs[0])
        if q is None:
            continue
        replace_with_quantized(g, [node], relu, q, QUANTIZED[node.op_type],
                               [*operands[0], *operands[1], q.inputs[1], q.inputs[2]],
                               name=node.name + "_quant", domain=MS_DOMAIN)
        count += 1
    return count


def _constant_operand(g: Graph, value: Value, rank: int | None, dtype: np.dtype) -> tuple[Value, Value, Value] | None:
    """``value``, a per-tensor quantized constant, as ``(integers, scale, zero point)`` of type ``dtype`` and rank
    ``rank`` (leading axes of size 1 added), else None."""
    w = weight(g, value)
    if w is None or rank is None or w.scale.size != 1 or w.zero_point.size != 1 or w.q.ndim > rank:
        return None
    shift = {(np.dtype(np.int8), np.dtype(np.uint8)): 128, (np.dtype(np.uint8), np.dtype(np.int8)): -128}.get(
        (w.q.dtype, np.dtype(dtype)), 0)
    if w.q.dtype not in (np.int8, np.uint8):
        return None
    q = w.q.astype(np.int16).reshape((1,) * (rank - w.q.ndim) + w.q.shape) + shift
    zp = int(w.zero_point.reshape(-1)[0]) + shift
    base = w.dq.inputs[0].name
    return (g.add_const(base + "_operand", q.astype(dtype)),
            g.add_const(base + "_operand_scale", w.scale.reshape(()).astype(np.float32)),
            g.add_const(base + "_operand_zero_point", np.array(zp, dtype)))
