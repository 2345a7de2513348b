"""QDQ output: int8 weights beyond +-64 become uint8 with zero point 128 (the same values).

onnxruntime's u8s8 kernels on x86 CPUs without VNNI (AVX2, AVX-512F) add pairs of uint8 x int8
products in int16, which saturates for weights beyond +-64; with uint8 weights it runs its u8u8
kernels, exact on every CPU (:func:`recal_onnx.quantized_ops.weight_inputs` does the same for the
QOperator format).

Before::  DequantizeLinear(w_int8, s_w, zeros_int8) -> Conv
After::   DequantizeLinear(w_int8 + 128 as uint8, s_w, 128s_uint8) -> Conv
"""

from __future__ import annotations

import numpy as np

from ..graph import Graph
from ..qdq import weight
from ..quantized_ops import saturation_free

WEIGHT_READERS = {"Conv": 1, "Gemm": 1, "MatMul": 1}


def saturation_free_weights(g: Graph) -> int:
    count = 0
    for node in list(g.nodes):
        index = WEIGHT_READERS.get(node.op_type)
        if index is None or len(node.input) <= index:
            continue
        w = weight(g, node.input[index])
        if w is None or w.q.dtype != np.int8 or np.any(w.zero_point != 0) or saturation_free(w.q):
            continue
        dq = w.dq
        zero_point = np.full(np.shape(w.zero_point), 128, np.uint8)
        dq.input[0] = g.add_const(dq.input[0] + "_u8", (w.q.astype(np.int16) + 128).astype(np.uint8))
        if len(dq.input) > 2:
            dq.input[2] = g.add_const(dq.input[2] + "_u8", zero_point)
        else:
            dq.input.append(g.add_const("w_zero_point_u8", zero_point))
        g.refresh()
        count += 1
    return count
