"""Activations become uint8: an int8 activation ``Q/DQ(s, zp)`` is the same as uint8 ``Q/DQ(s, zp + 128)``.

Before::  x -> QuantizeLinear(s, zp:int8) -> q [-> Squeeze / Transpose / Clip(lo, hi) ...] -> DQ(s, zp:int8)
After::   x -> QuantizeLinear(s, zp+128:uint8) -> q [-> ... / Clip(lo+128, hi+128) ...] -> DQ(s, zp+128:uint8)

onnxruntime's x86 kernels are fast for uint8 activations with int8 weights; int8 activations in
QOperator form are very slow. Weights (constant DQ inputs) stay int8.
"""

from __future__ import annotations

import numpy as np

from ..ir_edits import LAYOUT_OPS, Graph, input_of


def activations_to_uint8(g: Graph) -> int:
    count = 0
    for node in g.each("QuantizeLinear"):
        zp = g.const(input_of(node, 2))
        if zp is None or zp.dtype != np.int8:
            continue
        found = _dequantizers(g, node.outputs[0])
        if not found:
            continue
        readers, clips = found
        shifted = g.add_const(node.inputs[2].name + "_u8", _to_uint8(zp))
        node.replace_input_with(2, shifted)
        for reader in readers:
            if len(reader.inputs) > 2:
                reader.replace_input_with(2, shifted)
        for clip in clips:  # QCDQ: the integers' bounds move with them
            for i in (1, 2):
                bound = input_of(clip, i)
                if bound is not None:
                    clip.replace_input_with(i, g.add_const(bound.name + "_u8", _to_uint8(g.const(bound))))
        count += 1
    return count


def _to_uint8(values: np.ndarray) -> np.ndarray:
    return (values.astype(np.int16) + 128).astype(np.uint8)


def _dequantizers(g: Graph, value) -> tuple[list, list] | None:
    """The DequantizeLinear nodes that read ``value``, directly or through integer data movement (tf2onnx writes
    ``Q -> Squeeze / Transpose -> DQ``) or a Clip of constant int8 bounds (QCDQ: a narrow range, fewer bits), and
    those Clips; None where anything else (a graph output too) reads it."""
    found, clips, stack = [], [], [value]
    while stack:
        value = stack.pop()
        readers = g.consumers(value)
        if value.is_graph_output() or not readers:
            return None
        for reader in readers:
            if reader.op_type == "DequantizeLinear" and reader.inputs[0] is value:
                found.append(reader)
            elif reader.op_type in LAYOUT_OPS and reader.inputs[0] is value:
                stack.append(reader.outputs[0])
            elif reader.op_type == "Clip" and reader.inputs[0] is value and all(
                    g.const(b) is not None and g.const(b).dtype == np.int8 for b in reader.inputs[1:] if b is not None):
                clips.append(reader)
                stack.append(reader.outputs[0])
            else:
                return None
    return found, clips
