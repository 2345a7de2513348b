"""Fold per-channel Div / Mul / Add / Sub / BatchNormalization after a Conv or Gemm into its weight and bias.

Before::  x, W -> Conv -> Div(c) -> Add(b) -> BatchNormalization(gamma, beta, mean, var) -> y
After::   x, W' -> Conv(bias') -> y        with W' = W * a per output channel, bias' = a * bias + d

This is what PyTorch's eager QAT exports (``torch.ao`` ConvBn modules) and what keeps runtimes
from fusing QDQ convolutions. A quantized weight ``DQ(q, s, 0)`` is folded exactly by scaling its
per-channel scale ``s`` (and negating ``q`` where a factor is negative); the int8 values never change.
"""

from __future__ import annotations

import logging

import numpy as np

from ..ir_edits import Graph, Node, Value, attr, input_of, set_attr, set_input
from ..qdq import weight as weight_dq

log = logging.getLogger(__name__)


def fold_conv_affine(g: Graph) -> int:
    count = 0
    for node in g.each("Conv", "Gemm"):
        while True:
            nxt = g.only_consumer(node.outputs[0])
            if nxt is None:
                break
            shape = _channels(g, node)
            if shape is None:
                break
            affine = _affine_of(g, nxt, node.outputs[0], *shape)
            if affine is None or not _apply(g, node, *affine):
                break
            g.replace(nxt.outputs[0], node.outputs[0])  # (a graph output keeps its name)
            g.remove(nxt)
            count += 1
    return count


def _weight_layout(g: Graph, node: Node) -> int | None:
    """The weight axis that holds output channels: 0 for Conv and Gemm(transB=1), 1 for Gemm(transB=0)."""
    if node.op_type == "Conv":
        return 0
    if attr(node, "transA", 0) or attr(node, "alpha", 1.0) != 1.0 or attr(node, "beta", 1.0) != 1.0:
        return None
    return 0 if attr(node, "transB", 0) else 1


def _channels(g: Graph, node: Node) -> tuple[int, int] | None:
    """``(output channels, rank of the output)`` of a Conv (its weight's rank) or Gemm (2)."""
    axis = _weight_layout(g, node)
    if axis is None:
        return None
    w = g.const(node.inputs[1])
    if w is None:
        dq = weight_dq(g, node.inputs[1])
        if dq is None or g.uses(node.inputs[1]) != 1:
            return None
        w = dq.q
    return int(w.shape[axis]), (w.ndim if node.op_type == "Conv" else 2)


def _per_channel(value: np.ndarray, channels: int, rank: int) -> np.ndarray | None:
    """A constant that, under ONNX (numpy) broadcasting against an output of ``rank`` axes, varies along the
    channel axis (1) alone, as a vector of ``channels``; else None. Broadcasting aligns trailing axes: ``[C, 1, 1]``
    and ``[1, C, 1, 1]`` are per channel of a 2-D conv's output, ``[1, C]`` and ``[C]`` scale its last axis (width),
    and a Gemm's ``[C]`` or ``[1, C]`` is per channel of its 2-D output."""
    v = np.asarray(value, dtype=np.float64)
    if v.size == 1 and v.ndim <= rank:
        return np.full(channels, float(v.reshape(-1)[0]))
    if v.ndim > rank:
        return None
    aligned = (1,) * (rank - v.ndim) + v.shape
    if aligned[1] != channels or any(d != 1 for i, d in enumerate(aligned) if i != 1):
        return None
    return v.reshape(channels)


def _affine_of(g: Graph, node: Node, source: Value, channels: int, rank: int):
    """``(a, d)`` such that ``node(source) = a * source + d`` per channel, or None."""
    if node.op_type in ("Div", "Mul", "Add", "Sub") and node.inputs[0] is source and g.is_const(node.inputs[1]):
        c = _per_channel(g.const(node.inputs[1]), channels, rank)
        if c is None:
            return None
        ones, zeros = np.ones(channels), np.zeros(channels)
        if node.op_type == "Div":
            return (None, None) if np.any(c == 0) else (1.0 / c, zeros)
        return {"Mul": (c, zeros), "Add": (ones, c), "Sub": (ones, -c)}[node.op_type]
    if node.op_type == "BatchNormalization" and node.inputs[0] is source \
            and all(g.is_const(input_of(node, i)) for i in range(1, 5)) and not attr(node, "training_mode", 0) \
            and not any(g.uses(o) for o in node.outputs[1:]):
        gamma, beta, mean, var = (np.asarray(g.const(i), dtype=np.float64).reshape(-1) for i in node.inputs[1:5])
        if gamma.size != channels:
            return None
        a = gamma / np.sqrt(var + attr(node, "epsilon", 1e-5))
        return a, beta - mean * a
    return None


def _apply(g: Graph, node: Node, a: np.ndarray | None, d: np.ndarray | None) -> bool:
    if a is None:
        return False
    axis = _weight_layout(g, node)
    w_value = node.inputs[1]
    w = g.const(w_value)
    if w is not None:  # a float weight: scale it (a new initializer, so a shared weight stays intact)
        shape = [1] * w.ndim
        shape[axis] = -1
        node.replace_input_with(1, g.add_const(w_value.name, (w * a.reshape(shape)).astype(w.dtype)))
        dtype = w.dtype
    else:
        dq = weight_dq(g, w_value)
        if dq is None or not _fold_into_dq(g, dq, a, axis):
            return False
        dtype = g.const(dq.dq.inputs[1]).dtype
    old_bias = input_of(node, 2)
    bias = g.const(old_bias)
    if old_bias is not None and bias is None:
        return False
    bias = np.zeros(len(a)) if bias is None else np.asarray(bias, dtype=np.float64).reshape(-1)
    new_bias = g.add_const((old_bias.name if old_bias is not None else node.name) + "_bias",
                           (a * bias + d).astype(dtype))
    set_input(node, 2, new_bias)
    return True


def _fold_into_dq(g: Graph, dq, a: np.ndarray, axis: int) -> bool:
    """Scale a quantized weight per output channel by ``a`` by changing its scale (and signs)."""
    if dq.axis != axis and dq.scale.size != 1:
        return False
    if np.any(a < 0) and np.any(dq.zero_point != 0):
        return False
    channels = dq.q.shape[axis]
    scale = np.broadcast_to(dq.scale.reshape(-1), (channels,)).astype(np.float64) * np.abs(a)
    q = dq.q
    if np.any(a < 0):
        shape = [1] * q.ndim
        shape[axis] = -1
        sign = np.where(a < 0, -1, 1).reshape(shape)
        info = np.iinfo(q.dtype)
        flipped = q.astype(np.int32) * sign
        if flipped.max() > info.max or flipped.min() < info.min:
            log.warning("fold: weight %s clipped while negating a channel (int8 -128)", dq.dq.inputs[0].name)
        q = np.clip(flipped, info.min, info.max).astype(q.dtype)
    zp = np.broadcast_to(dq.zero_point.reshape(-1), (channels,)).astype(dq.zero_point.dtype)
    node = dq.dq
    node.replace_input_with(0, g.add_const(node.inputs[0].name, q))
    node.replace_input_with(1, g.add_const(node.inputs[1].name, scale.astype(g.const(node.inputs[1]).dtype)))
    old_zp = input_of(node, 2)
    set_input(node, 2, g.add_const(old_zp.name if old_zp is not None else "zero_point", zp))
    set_attr(node, "axis", axis)
    return True
