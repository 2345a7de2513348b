"""Recognising quantized tensors in a QDQ graph: activations ``DQ(q, s, zp)`` and constant weights."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .ir_edits import Graph, Node, Value, attr, input_of


EIGHT_BITS = (np.dtype(np.uint8), np.dtype(np.int8))  # the activations onnxruntime's integer kernels read


@dataclass(frozen=True)
class QTensor:
    """A float tensor that is ``DequantizeLinear(q, scale, zero_point)`` of an integer activation ``q``."""

    q: Value
    scale: Value
    zero_point: Value
    dq: Node


@dataclass(frozen=True)
class QWeight:
    """A constant weight ``DequantizeLinear(q_const, scale_const, zp_const, axis)``."""

    q: np.ndarray
    scale: np.ndarray
    zero_point: np.ndarray
    axis: int
    dq: Node


def activation(g: Graph, value: Value | None) -> QTensor | None:
    """``value`` as a dequantized activation (its integer source is not a constant), else None."""
    node = g.producer(value)
    if node is None or node.op_type != "DequantizeLinear" or g.is_const(node.inputs[0]):
        return None
    scale, zero_point = input_of(node, 1), input_of(node, 2)
    if not g.is_const(scale) or not g.is_const(zero_point):
        return None
    if g.const(scale).size != 1:
        return None  # per-channel activations are not supported by the QLinear ops
    if g.const(zero_point).dtype not in EIGHT_BITS:
        return None  # a 16-bit activation (mixed precision): no integer kernel reads it, its readers stay float
    return QTensor(node.inputs[0], scale, zero_point, node)


def sixteen_bit_input(g: Graph, value: Value | None) -> np.dtype | None:
    """The type of ``value`` where it is a dequantized 16-bit activation (mixed precision: no integer kernel reads
    it), else None."""
    node = g.producer(value)
    if node is None or node.op_type != "DequantizeLinear" or g.is_const(node.inputs[0]):
        return None
    zero_point = g.const(input_of(node, 2))
    return zero_point.dtype if zero_point is not None and zero_point.dtype not in EIGHT_BITS else None


def sixteen_bit_output(g: Graph, value: Value) -> np.dtype | None:
    """The type ``value`` is quantized to where a QuantizeLinear quantizes it (or its Relu / Clip) to 16 bits,
    else None."""
    for reader in g.consumers(value):
        if reader.op_type in ("Relu", "Clip") and reader.inputs[0] is value:
            found = sixteen_bit_output(g, reader.outputs[0])
        else:
            zero_point = g.const(input_of(reader, 2)) if reader.op_type == "QuantizeLinear" else None
            found = zero_point.dtype if zero_point is not None and zero_point.dtype not in EIGHT_BITS else None
        if found is not None:
            return found
    return None


def sixteen_bits(g: Graph, inputs=(), outputs=()) -> tuple[Value, np.dtype, bool] | None:
    """``(value, type, is_input)`` for the first of ``inputs`` that is a dequantized 16-bit activation, else the first
    of ``outputs`` quantized to 16 bits (mixed precision: no integer kernel reads or writes them); None if none."""
    found = [(v, sixteen_bit_input(g, v), True) for v in inputs if v is not None] + [
        (v, sixteen_bit_output(g, v), False) for v in outputs]
    return next((item for item in found if item[1] is not None), None)


def weight(g: Graph, value: Value | None) -> QWeight | None:
    """``value`` as a dequantized constant weight, else None."""
    node = g.producer(value)
    if node is None or node.op_type != "DequantizeLinear" or not g.is_const(node.inputs[0]):
        return None
    zero_point = input_of(node, 2)
    if not g.is_const(node.inputs[1]) or (zero_point is not None and not g.is_const(zero_point)):
        return None
    q = g.const(node.inputs[0])
    zp = g.const(zero_point) if zero_point is not None else np.zeros((), q.dtype)
    axis = attr(node, "axis", 1)
    return QWeight(q, g.const(node.inputs[1]), zp, axis if axis >= 0 else axis + q.ndim, node)


def output_axis(node: Node, rank: int) -> int:
    """The axis of a layer's weight that holds its output channels, the one integer kernels take scales along:
    Conv's 0, ConvTranspose's 1, Gemm's by ``transB``, MatMul's last."""
    if node.op_type == "Conv":
        return 0
    if node.op_type == "ConvTranspose":
        return 1
    if node.op_type == "Gemm":
        return 0 if attr(node, "transB", 0) else 1
    return rank - 1


def along_axis(dq: Node, q: np.ndarray, *params: np.ndarray) -> list[np.ndarray] | None:
    """A DequantizeLinear's per-tensor or per-channel ``params`` (its scale, its zero point) shaped to broadcast
    against its integers ``q`` along its ``axis``; None for blocked quantization or an axis the integers lack."""
    if attr(dq, "block_size", 0):
        return None  # blocked: the converter's Q/DQ check refuses it by name
    if all(p.size == 1 for p in params):
        return [p.reshape(()) for p in params]
    axis = attr(dq, "axis", 1)
    axis = axis + q.ndim if axis < 0 else axis
    if not 0 <= axis < q.ndim or any(p.size not in (1, q.shape[axis]) for p in params):
        return None
    shape = [1] * q.ndim
    shape[axis] = -1
    return [p.reshape(shape) if p.size != 1 else p.reshape(()) for p in params]


def replace_moved_weight(g: Graph, node: Node, w: QWeight, moved: np.ndarray, axis: int | None, suffix: str) -> None:
    """``node``, which moves the dequantized weight ``w`` (a Transpose, a Reshape), replaced by a DequantizeLinear of
    ``moved`` (``w``'s integers moved the same way; per channel on ``axis`` unless None); ``w``'s own
    DequantizeLinear goes at once when nothing else reads it (large models)."""
    dq = w.dq
    q = g.add_const(dq.inputs[0].name + suffix, np.ascontiguousarray(moved))
    g.add_node("DequantizeLinear", [q, *dq.inputs[1:3]], name=(node.name or node.op_type.lower()) + "_weight",
               replaces=node.outputs[0], **({} if axis is None else {"axis": axis}))
    g.remove(node)
    if not g.uses(dq.outputs[0]):
        q_old = dq.inputs[0]
        g.remove(dq)
        g.drop_if_unused(q_old)


def quantize_node_of(g: Graph, value: Value) -> Node | None:
    """The QuantizeLinear that is the only reader of ``value`` (activation scale and zp constant), else None."""
    node = g.only_consumer(value)
    return node if node is not None and quantizes(g, node, value) else None


def quantizes(g: Graph, node: Node, value: Value) -> bool:
    """Whether ``node`` is a QuantizeLinear of ``value`` with a constant scalar scale and a constant zero point."""
    return (node.op_type == "QuantizeLinear" and node.inputs[0] is value and g.is_const(input_of(node, 1))
            and g.is_const(input_of(node, 2)) and g.const(node.inputs[1]).size == 1
            and g.const(node.inputs[2]).dtype in EIGHT_BITS)


def scalar(g: Graph, value: Value) -> float:
    return float(np.asarray(g.const(value)).reshape(-1)[0])


def same_qparams(g: Graph, scale_a: Value, zp_a: Value, scale_b: Value, zp_b: Value) -> bool:
    a_s, b_s = g.const(scale_a), g.const(scale_b)
    a_z, b_z = g.const(zp_a), g.const(zp_b)
    return (a_s is not None and b_s is not None and a_z is not None and b_z is not None
            and a_z.dtype == b_z.dtype and np.array_equal(a_s.reshape(-1), b_s.reshape(-1))
            and np.array_equal(a_z.reshape(-1), b_z.reshape(-1)))


def signedness_shift(source: np.dtype, target: np.dtype) -> int:
    """What an 8-bit integer (and its zero point) gains moving from ``source`` to ``target``, the same value on the
    same grid: +128 from int8 to uint8, -128 back, 0 otherwise."""
    return {(np.dtype(np.int8), np.dtype(np.uint8)): 128,
            (np.dtype(np.uint8), np.dtype(np.int8)): -128}.get((np.dtype(source), np.dtype(target)), 0)


def without_zero_point(q: np.ndarray, zero_point: np.ndarray) -> np.ndarray | None:
    """``q - zero_point`` (the zero point broadcast against ``q``) as symmetric int8, where every value fits; else
    None."""
    values = q.astype(np.int16) - zero_point.astype(np.int16)
    if values.size and (values.min() < -128 or values.max() > 127):
        return None
    return values.astype(np.int8)


def dequantized(g: Graph, dq: Node) -> np.ndarray | None:
    """The float values a DequantizeLinear of constant 8- or 32-bit integers computes, as onnxruntime computes them:
    ``float32(q - zp) * scale`` in float32, per tensor or per channel; None where it is not that (blocked, computed
    inputs)."""
    q, scale, zero_point = g.const(dq.inputs[0]), g.const(input_of(dq, 1)), input_of(dq, 2)
    if q is None or scale is None or q.dtype not in (np.int8, np.uint8, np.int32) \
            or (zero_point is not None and not g.is_const(zero_point)):
        return None
    shaped = along_axis(dq, q, scale, g.const(zero_point) if zero_point is not None else np.zeros((), q.dtype))
    if shaped is None:
        return None
    scale, zp = shaped
    return (q.astype(np.int64) - zp.astype(np.int64)).astype(np.float32) * scale.astype(np.float32)


def constant_operand(g: Graph, value: Value, rank: int | None, dtype: np.dtype) -> tuple[Value, Value, Value] | None:
    """``value``, a per-tensor quantized constant, as ``(integers, scale, zero point)`` of type ``dtype`` and rank
    ``rank`` (leading axes of size 1 added; int8 and uint8 shifted by 128 with the zero point: the same values), else
    None: an operand of a QLinear op beside an activation (quantize_static's bias after a MatMul, an attention's
    scale, ViT's class token)."""
    w = weight(g, value)
    if w is None or rank is None or w.scale.size != 1 or w.zero_point.size != 1 or w.q.ndim > rank \
            or w.q.dtype not in (np.int8, np.uint8):
        return None
    shift = signedness_shift(w.q.dtype, dtype)
    q = w.q.astype(np.int16).reshape((1,) * (rank - w.q.ndim) + w.q.shape) + shift
    zp = int(w.zero_point.reshape(-1)[0]) + shift
    base = w.dq.inputs[0].name
    return (g.add_const(base + "_operand", q.astype(dtype)),
            g.add_const(base + "_operand_scale", w.scale.reshape(()).astype(np.float32)),
            g.add_const(base + "_operand_zero_point", np.array(zp, dtype)))
