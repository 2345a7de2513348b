"""Ops that do not change quantized values run on the integers.

Before::  q -> DequantizeLinear(s, zp) -> MaxPool -> y
After::   q -> MaxPool -> q' -> DequantizeLinear(s, zp) -> y

For MaxPool, Reshape, Flatten, Transpose, Squeeze, Unsqueeze, Identity, Slice, Gather, GatherElements, Expand, Tile
(the values of input 0 moved: a BERT pooler's first token, say), a nearest-neighbour Resize (a detector's
upsampling: each output is one of its inputs; not tf_crop_and_resize, whose extrapolated 0.0 is no input), Split
(each of its outputs dequantized on its own: a channel split or shuffle moves integers), and a constant-mode Pad of
zeros (Keras's ZeroPadding2D before a pool): it pads with the zero point, the integer of 0. A ``Relu`` or
constant-bound ``Clip`` (:func:`~recal_onnx.quantized_ops.integer_bounds`) becomes nothing where its bounds lie
beyond the integers' range (a ReLU on a lowest zero point, a ReLU6 after an op whose range already stops at 6),
``Max`` / ``Min`` where they lie on the grid; a bound between grid points would round differently, and the op stays
float. An average pool is not among them: its mean falls between grid points, and rounding it to its input's grid
would invent a quantization the QAT model never had (logits off by several output steps); one that a QuantizeLinear
follows becomes QLinear*Pool (:mod:`.pool_to_qlinear`), one that none follows stays float, exact.
"""

from __future__ import annotations

import numpy as np

from ..ir_edits import Graph, attr, input_of
from ..qdq import activation
from ..quantized_ops import clamp_integers, integer_bounds

PASSTHROUGH = {"MaxPool", "Reshape", "Flatten", "Transpose", "Squeeze", "Unsqueeze", "Identity", "Slice", "Gather",
               "GatherElements", "Expand", "Tile"}
SPLITS = {"Split"}  # several outputs, each dequantized on its own
OPSET_12 = {"MaxPool", "Clip", "Max", "Min", "Relu"}  # 8-bit integers from opset 12 (a model at 11 keeps them float)


def _pads_zeros(g: Graph, node) -> bool:
    """A Pad that pads with 0.0 (constant mode, constant pads, no axes input)."""
    if attr(node, "mode", "constant") not in ("constant", b"constant") or len(node.inputs) > 3:
        return False
    if len(node.inputs) < 2 or node.inputs[1] is None or not g.is_const(node.inputs[1]):
        return False
    value = input_of(node, 2)
    return value is None or g.is_const(value) and float(np.asarray(g.const(value)).reshape(-1)[0]) == 0.0


def _selects(node) -> bool:
    """A Resize whose every output is one of its input's values (nearest mode, no crop-and-resize extrapolation)."""
    def text(name: str, default: str) -> str:
        value = attr(node, name, default)
        return value.decode() if isinstance(value, bytes) else value

    return text("mode", "nearest") == "nearest" and \
        text("coordinate_transformation_mode", "half_pixel") != "tf_crop_and_resize"


def int8_passthrough(g: Graph, clamps: bool = True) -> int:
    """Move every DequantizeLinear past the data movement after it (and, with ``clamps``, past ReLU / Clip
    bounds that cut nothing); return how many ops now run on the integers. A ``qdq`` model keeps its clamps
    (onnxruntime fuses them with the conv before them) and moves data only."""
    count = 0
    changed = True
    while changed:
        changed = False
        for node in g.each():
            if not node.inputs:
                continue
            x = activation(g, node.inputs[0])
            if x is None:
                continue
            if node.op_type == "MaxPool" and len([o for o in node.outputs if o.name or o.uses()]) > 1:
                continue  # the Indices output has no integer meaning
            if node.op_type in OPSET_12 and g.opset < 12:
                continue  # no 8-bit type before opset 12: it stays float, exact
            if node.op_type in SPLITS:
                parts = g.add_node(node.op_type, [x.q, *node.inputs[1:]], name=node.name + "_int8",
                                   outputs=len(node.outputs), **node.attributes).outputs
                for part, old in zip(parts, node.outputs):
                    g.add_node("DequantizeLinear", [part, x.scale, x.zero_point], name=f"{old.name}_dq",
                               replaces=old)
                g.remove(node)
                count += 1
                changed = True
                continue
            if node.op_type in PASSTHROUGH:
                q_out = g.add_node(node.op_type, [x.q, *node.inputs[1:]], name=node.name + "_int8",
                                   **node.attributes).outputs[0]
            elif node.op_type == "Resize" and _selects(node):
                q_out = g.add_node("Resize", [x.q, *node.inputs[1:]], name=node.name + "_int8",
                                   **node.attributes).outputs[0]
            elif node.op_type == "Pad" and _pads_zeros(g, node):
                pad_value = [] if x.zero_point is None else [x.zero_point]  # no zero point: 0 is the integer of 0
                q_out = g.add_node("Pad", [x.q, node.inputs[1], *pad_value], name=node.name + "_int8",
                                   mode="constant").outputs[0]
            elif clamps and node.op_type in ("Relu", "Clip") and \
                    (clamp := integer_bounds(g, node, x.scale, x.zero_point, on_grid=True)) is not None:
                q_out = clamp_integers(g, node, x.q, clamp, g.const(x.zero_point).dtype)
            else:
                continue
            g.add_node("DequantizeLinear", [q_out, x.scale, x.zero_point], name=node.name + "_dq",
                       replaces=node.outputs[0])
            g.remove(node)
            count += 1
            changed = True
    return count

