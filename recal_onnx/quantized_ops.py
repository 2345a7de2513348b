"""Writing quantized operators: the pieces every QOperator pass shares.

Int32 biases, int8 weight inputs, the optional ``Relu -> QuantizeLinear`` tail after an op, and
the replacement of a float op (and that tail) by one quantized node.
"""

from __future__ import annotations

import numpy as np
import onnx

from .graph import Graph
from .qdq import QTensor, QWeight, quantize_node_of, scalar


def quantized_bias(g: Graph, node: onnx.NodeProto, x: QTensor, w: QWeight, index: int) -> str | None:
    """The int32 bias ``round(bias / (s_x * s_w))`` for ``node.input[index]``; '' when there is none,
    None when the bias is not a constant."""
    if len(node.input) <= index or not node.input[index]:
        return ""
    bias = g.const(node.input[index])
    if bias is None:
        return None
    scale = scalar(g, x.scale) * w.scale.astype(np.float64).reshape(-1)
    values = np.round(np.asarray(bias, np.float64).reshape(-1) / scale)
    info = np.iinfo(np.int32)
    return g.add_const(node.input[index] + "_int32", np.clip(values, info.min, info.max).astype(np.int32))


# onnxruntime's u8s8 kernels on x86 without VNNI (AVX2, AVX-512F) add pairs of uint8 x int8 products
# in int16 (vpmaddubsw), which saturates once |w1| + |w2| > 128: weights within +-64 never do.
SATURATION_FREE_WEIGHT = 64


def saturation_free(q: np.ndarray) -> bool:
    """Whether int8 weights ``q`` are exact in every x86 u8s8 kernel (``|q| <= 64``)."""
    return q.size == 0 or int(np.abs(q.astype(np.int16)).max()) <= SATURATION_FREE_WEIGHT


def weight_inputs(g: Graph, w: QWeight, channels_axis: int) -> tuple[str, str, str] | None:
    """(q, scale, zero point) names for an int8 symmetric weight, per tensor or per output channel.

    Weights beyond +-64 are written as uint8 with zero point 128 (the same values): onnxruntime then
    runs its u8u8 kernels, exact on every CPU, instead of u8s8 ones that can saturate on x86 without VNNI.
    """
    if w.q.dtype != np.int8 or np.any(w.zero_point != 0):
        return None
    if w.scale.size != 1 and (w.axis != channels_axis or w.scale.size != w.q.shape[channels_axis]):
        return None
    scale = w.scale.reshape(-1) if w.scale.size != 1 else w.scale.reshape(())
    scale_name = g.add_const(w.dq.input[1] + "_w", scale.astype(np.float32))
    if saturation_free(w.q):
        return w.dq.input[0], scale_name, g.add_const("w_zero_point", np.zeros(scale.shape, np.int8))
    shifted = (w.q.astype(np.int16) + 128).astype(np.uint8)
    return (g.add_const(w.dq.input[0] + "_u8", shifted), scale_name,
            g.add_const("w_zero_point_u8", np.full(scale.shape, 128, np.uint8)))


def output_tail(g: Graph, name: str) -> tuple[onnx.NodeProto | None, onnx.NodeProto | None]:
    """``(relu, quantize)`` after ``name``: an optional Relu, then the QuantizeLinear that reads it."""
    relu = g.only_consumer(name)
    if relu is not None and relu.op_type == "Relu":
        return relu, quantize_node_of(g, relu.output[0])
    return None, quantize_node_of(g, name)


def zero_point_is_lowest(g: Graph, name: str) -> bool:
    """Whether the zero point ``name`` is its type's lowest integer: then every value is >= real 0,
    so a ReLU on those integers changes nothing."""
    zp = g.const(name)
    return int(zp.reshape(-1)[0]) == np.iinfo(zp.dtype).min


def replace_with_quantized(g: Graph, replaced: list[onnx.NodeProto], relu: onnx.NodeProto | None,
                           q: onnx.NodeProto, op_type: str, inputs: list[str], *, name: str, domain: str = "",
                           **attrs) -> None:
    """Replace ``replaced`` (with ``relu`` and ``q``) by one ``op_type`` node that writes ``q``'s integers.

    A ReLU costs nothing when ``q``'s zero point is the lowest integer (the output clamp is the ReLU);
    otherwise it becomes ``Max(q, zero_point)`` on the integers.
    """
    out = q.output[0]
    if relu is not None and not zero_point_is_lowest(g, q.input[2]):
        out = g.fresh(q.output[0] + "_prerelu")
    g.remove(*replaced, *(n for n in (relu, q) if n is not None))
    g.add_node(op_type, inputs, [out], name=name, domain=domain, **attrs)
    if out != q.output[0]:
        g.add_node("Max", [out, q.input[2]], [q.output[0]], name=relu.name + "_int8")
