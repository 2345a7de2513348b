"""Recognising quantized tensors in a QDQ graph: activations ``DQ(q, s, zp)`` and constant weights."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx

from .graph import Graph, attr


@dataclass(frozen=True)
class QTensor:
    """A float tensor that is ``DequantizeLinear(q, scale, zero_point)`` of an integer activation ``q``."""

    q: str
    scale: str
    zero_point: str
    dq: onnx.NodeProto


@dataclass(frozen=True)
class QWeight:
    """A constant weight ``DequantizeLinear(q_const, scale_const, zp_const, axis)``."""

    q: np.ndarray
    scale: np.ndarray
    zero_point: np.ndarray
    axis: int
    dq: onnx.NodeProto


def activation(g: Graph, name: str) -> QTensor | None:
    """``name`` as a dequantized activation (its integer source is not a constant), else None."""
    node = g.producer.get(name)
    if node is None or node.op_type != "DequantizeLinear" or g.is_const(node.input[0]):
        return None
    if len(node.input) < 3 or not node.input[2] or not g.is_const(node.input[1]) or not g.is_const(node.input[2]):
        return None
    if g.const(node.input[1]).size != 1:
        return None  # per-channel activations are not supported by the QLinear ops
    return QTensor(node.input[0], node.input[1], node.input[2], node)


def weight(g: Graph, name: str) -> QWeight | None:
    """``name`` as a dequantized constant weight, else None."""
    node = g.producer.get(name)
    if node is None or node.op_type != "DequantizeLinear" or not g.is_const(node.input[0]):
        return None
    if not g.is_const(node.input[1]) or (len(node.input) > 2 and node.input[2] and not g.is_const(node.input[2])):
        return None
    q = g.const(node.input[0])
    zp = g.const(node.input[2]) if len(node.input) > 2 and node.input[2] else np.zeros((), q.dtype)
    axis = attr(node, "axis", 1)
    return QWeight(q, g.const(node.input[1]), zp, axis if axis >= 0 else axis + q.ndim, node)


def quantize_node_of(g: Graph, name: str) -> onnx.NodeProto | None:
    """The QuantizeLinear that is the only reader of ``name`` (activation scale and zp constant), else None."""
    node = g.only_consumer(name)
    if node is None or node.op_type != "QuantizeLinear" or node.input[0] != name:
        return None
    if len(node.input) < 3 or not g.is_const(node.input[1]) or not g.is_const(node.input[2]):
        return None
    return node if g.const(node.input[1]).size == 1 else None


def scalar(g: Graph, name: str) -> float:
    return float(np.asarray(g.const(name)).reshape(-1)[0])


def same_qparams(g: Graph, scale_a: str, zp_a: str, scale_b: str, zp_b: str) -> bool:
    a_s, b_s = g.const(scale_a), g.const(scale_b)
    a_z, b_z = g.const(zp_a), g.const(zp_b)
    return (a_s is not None and b_s is not None and a_z is not None and b_z is not None
            and a_z.dtype == b_z.dtype and np.array_equal(a_s.reshape(-1), b_s.reshape(-1))
            and np.array_equal(a_z.reshape(-1), b_z.reshape(-1)))
