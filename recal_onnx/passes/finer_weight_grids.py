"""A layer whose float bias lies between the int32 steps its integer kernel holds, and whose weights leave room, holds
its weights on a finer grid: the same values, and a bias grid as much finer.

The integer kernels hold a bias in steps of input scale x weight scale, so a float bias (a BatchNorm folded into the
layer after training: AIMET's export keeps its BatchNorms apart) is rounded by up to half such a step. With 4-bit
weights (AIMET's W4A8) that step is 16 times an 8-bit weight's: half of it moved 0.5% of a ResNet's integers by a step,
and verification refused the conversion. Weights within +-32 are multiplied by the largest power of two that keeps
them within +-64 (exact on every CPU, as 7-bit weights are) and their scale divided by it: ``q * k * (s / k)`` is
``q * s`` bit for bit, and the bias rounds on a grid ``k`` times finer.

Before::  DQ(w: int8 within +-8, s) -> Conv(x, w, b)             (b rounded to steps of s_x * s)
After::   DQ(w * 8, s / 8)        -> Conv(x, w, b)             (b rounded to steps of s_x * s / 8)
"""

from __future__ import annotations

import numpy as np

from ..ir_edits import Graph, input_of
from ..qdq import activation, weight
from ..quantized_ops import bias_steps, on_grid

LIMIT = 64  # the largest |weight| exact on every CPU (onnxruntime's u8s8 kernels without VNNI)
BIASED = ("Conv", "Gemm")  # the layers whose integer kernels hold a bias


def finer_weight_grids(g: Graph) -> int:
    count = 0
    for node in g.each(*BIASED):
        x, w, bias = activation(g, input_of(node, 0)), weight(g, input_of(node, 1)), g.const(input_of(node, 2))
        if x is None or w is None or bias is None or w.q.dtype != np.int8 or np.any(w.zero_point != 0):
            continue
        largest = int(np.abs(w.q.astype(np.int16)).max(initial=0))
        if not largest or largest > LIMIT // 2 or not np.all(np.isfinite(bias)) or on_grid(*bias_steps(g, bias, x, w)):
            continue
        k = 2 ** int(np.floor(np.log2(LIMIT / largest)))
        dq = w.dq
        q = g.add_const(dq.inputs[0].name + "_finer", (w.q.astype(np.int16) * k).astype(np.int8))
        scale = g.add_const(dq.inputs[1].name + "_finer", (w.scale / np.float32(k)).astype(np.float32))
        finer = g.add_node("DequantizeLinear", [q, scale, *dq.inputs[2:3]], name=f"{dq.name or 'weight'}_finer",
                           **{name: a.value for name, a in dq.attributes.items()})
        node.replace_input_with(1, finer.outputs[0])
        count += 1
    return count
