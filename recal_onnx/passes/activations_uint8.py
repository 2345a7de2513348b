"""Activations become uint8: an int8 activation ``Q/DQ(s, zp)`` is the same as uint8 ``Q/DQ(s, zp + 128)``.

Before::  x -> QuantizeLinear(s, zp:int8) -> q -> DequantizeLinear(s, zp:int8)
After::   x -> QuantizeLinear(s, zp+128:uint8) -> q -> DequantizeLinear(s, zp+128:uint8)

onnxruntime's x86 kernels are fast for uint8 activations with int8 weights; int8 activations in
QOperator form are very slow. Weights (constant DQ inputs) stay int8.
"""

from __future__ import annotations

import numpy as np

from ..graph import Graph


def activations_to_uint8(g: Graph) -> int:
    count = 0
    for node in list(g.nodes):
        if node.op_type != "QuantizeLinear" or len(node.input) < 3 or not g.is_const(node.input[2]):
            continue
        zp = g.const(node.input[2])
        if zp.dtype != np.int8:
            continue
        readers = g.consumers.get(node.output[0], [])
        if node.output[0] in g.outputs or not readers or any(
                r.op_type != "DequantizeLinear" or r.input[0] != node.output[0] for r in readers):
            continue
        shifted = g.add_const(node.input[2] + "_u8", (zp.astype(np.int16) + 128).astype(np.uint8))
        node.input[2] = shifted
        for reader in readers:
            if len(reader.input) > 2:
                reader.input[2] = shifted
        count += 1
    g.refresh()
    return count


def scalar_activation_qparams(g: Graph) -> int:
    """Give activation Q/DQ nodes scalar scale and zero point (``[1]``-shaped ones, as ``torch.ao``
    exports them, break onnxruntime's fused QLinear ops at type inference)."""
    count = 0
    for node in g.nodes:
        if node.op_type not in ("QuantizeLinear", "DequantizeLinear") or len(node.input) < 3:
            continue
        if node.op_type == "DequantizeLinear" and g.is_const(node.input[0]):
            continue  # a weight: per-channel parameters stay as they are
        for i in (1, 2):
            value = g.const(node.input[i]) if node.input[i] else None
            if value is not None and value.size == 1 and value.ndim > 0:
                node.input[i] = g.add_const(node.input[i] + "_scalar", value.reshape(()))
                count += 1
    g.refresh()
    return count
