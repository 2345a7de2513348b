"""Int8 weights beyond +-64 become uint8 with zero point 128 (the same values), in both formats.

For x86 CPUs without VNNI (:mod:`recal_onnx.cpu`): onnxruntime's u8s8 kernels there add pairs of
uint8 x int8 products in int16, which saturates once ``|w1| + |w2| > 128``; with uint8 weights it runs
its u8u8 kernels, exact on every CPU. Weights within +-64 never saturate and stay int8.

Before::  DequantizeLinear(w_int8, s_w, 0) -> Conv       QLinearConv(x, .., w_int8, s_w, 0, ..)
After::   DequantizeLinear(w_int8 + 128, s_w, 128) -> Conv   QLinearConv(x, .., w_uint8, s_w, 128, ..)

(an asymmetric weight's zero point moves with it: ``zp + 128``).
"""

from __future__ import annotations

import logging

import numpy as np
import onnx

from ..cpu import int8_weights_exact_here
from ..ir_edits import Graph, Node, input_of, set_input
from ..qdq import weight

log = logging.getLogger(__name__)

SATURATION_FREE_WEIGHT = 64  # |w1| + |w2| <= 128 for any two such weights
# op -> (index of its integer weight, index of the weight's zero point); QDQ ops read DequantizeLinear(w)
INTEGER_WEIGHTS = {"QLinearConv": (3, 5), "QGemm": (3, 5), "MatMulIntegerToFloat": (1, 5)}
QDQ_WEIGHTS = {"Conv": 1, "Gemm": 1, "MatMul": 1}


def saturation_free(q: np.ndarray) -> bool:
    """Whether int8 weights ``q`` are exact in every x86 u8s8 kernel (``|q| <= 64``)."""
    return q.size == 0 or int(np.abs(q.astype(np.int16)).max()) <= SATURATION_FREE_WEIGHT


def _weight_slots(g: Graph):
    """``(node, index of its int8 weight, index of the weight's zero point)`` of each integer or QDQ layer."""
    for node in g.each():
        if node.op_type in QDQ_WEIGHTS and len(node.inputs) > QDQ_WEIGHTS[node.op_type]:
            w = weight(g, node.inputs[QDQ_WEIGHTS[node.op_type]])
            slots = None if w is None else (w.dq, 0, 2)
        elif node.op_type in INTEGER_WEIGHTS and len(node.inputs) > INTEGER_WEIGHTS[node.op_type][1]:
            slots = (node, *INTEGER_WEIGHTS[node.op_type])
        else:
            continue
        if slots is not None:
            yield slots


def saturating_layers(g: Graph) -> int:
    """How many layers have int8 weights beyond +-64 (those that saturate on x86 without VNNI)."""
    count = 0
    for node, q_index, zp_index in _weight_slots(g):
        q = g.const(node.inputs[q_index])
        count += q is not None and q.dtype == np.int8 and not saturation_free(q)
    return count


def uint8_weights(g: Graph) -> int:
    return sum(_shift(g, *slots) for slots in list(_weight_slots(g)))


def _shift(g: Graph, node: Node, q_index: int, zp_index: int) -> bool:
    q = g.const(node.inputs[q_index])
    has_zp = input_of(node, zp_index) is not None
    zp = g.const(node.inputs[zp_index]) if has_zp else np.zeros((), np.int8)
    if q is None or zp is None or q.dtype != np.int8 or saturation_free(q):
        return False
    node.replace_input_with(q_index, g.add_const(node.inputs[q_index].name + "_u8",
                                                 (q.astype(np.int16) + 128).astype(np.uint8)))
    shape = np.shape(zp) if has_zp else np.shape(g.const(node.inputs[1]))  # a DequantizeLinear's scale
    set_input(node, zp_index, g.add_const("w_zero_point_u8", (np.broadcast_to(zp, shape).astype(np.int16) + 128)
                                          .astype(np.uint8)))
    return True


def uint8_twin(model: onnx.ModelProto) -> onnx.ModelProto | None:
    """``model`` with every int8 weight beyond +-64 stored as uint8, zero point 128 (a new model, the same values);
    None where it has none."""
    g = Graph(model)
    return g.commit() if uint8_weights(g) else None


def exact_on_this_cpu(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model``, or on a CPU whose int8 kernels saturate its uint8-weight twin (a new model; the same values),
    so that running it here measures the model, not this CPU."""
    if int8_weights_exact_here():
        return model
    twin = uint8_twin(model)
    if twin is None:
        return model
    log.debug("running the uint8-weight twin of the model: int8 weights beyond +-64 saturate on this CPU")
    return twin
