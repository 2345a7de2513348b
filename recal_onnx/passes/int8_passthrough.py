"""Ops that do not change quantized values run on the integers.

Before::  q -> DequantizeLinear(s, zp) -> MaxPool -> y
After::   q -> MaxPool -> q' -> DequantizeLinear(s, zp) -> y

For MaxPool, Reshape, Flatten, Transpose, Squeeze, Unsqueeze, Identity. ``Relu`` becomes nothing
when ``zp`` is the lowest value (every integer is already >= the real 0) and ``Max(q, zp)``
otherwise. A constant-bound ``Clip`` (ReLU6 after an op whose range already stops at 6) becomes nothing
where a bound lies beyond the integers' range, ``Max`` / ``Min`` where it lies on their grid; elsewhere it
would round differently, and stays float. A GlobalAveragePool / AveragePool / spatial ReduceMean that no QuantizeLinear follows (directly
or through one shape-only op: :mod:`.pool_to_qlinear` converts those) keeps its input's scale (an average stays inside its inputs' range) as QLinearGlobalAveragePool /
QLinearAveragePool.
"""

from __future__ import annotations

from onnx import helper

from ..graph import Graph
import numpy as np

from ..qdq import activation, scalar
from ..quantized_ops import clamp_bounds, zero_point_is_lowest
from .pool_to_qlinear import average_pool_kind, make_qlinear_pool, quantize_after

PASSTHROUGH = {"MaxPool", "Reshape", "Flatten", "Transpose", "Squeeze", "Unsqueeze", "Identity"}


def int8_passthrough(g: Graph) -> int:
    count = 0
    changed = True
    while changed:
        changed = False
        for node in list(g.nodes):
            if node not in g.nodes or not node.input:
                continue
            x = activation(g, node.input[0])
            if x is None:
                continue
            if node.op_type == "MaxPool" and len([o for o in node.output if o]) > 1:
                continue  # the Indices output has no integer meaning
            out = node.output[0]
            if node.op_type in PASSTHROUGH:
                q_out = g.fresh(out + "_q")
                g.add_node(node.op_type, [x.q, *node.input[1:]], [q_out], name=node.name + "_int8",
                           **{a.name: helper.get_attribute_value(a) for a in node.attribute})
            elif node.op_type == "Relu":
                if zero_point_is_lowest(g, x.zero_point):
                    q_out = x.q
                else:
                    q_out = g.fresh(out + "_q")
                    g.add_node("Max", [x.q, x.zero_point], [q_out], name=node.name + "_int8")
            elif node.op_type == "Clip" and (clamp := _integer_clip(g, node, x)) is not None:
                q_out = x.q
                for op, value in clamp:
                    bound = g.add_const(f"{node.name or 'clip'}_{op.lower()}", np.array(value, g.const(x.zero_point).dtype))
                    q_out = g.add_node(op, [q_out, bound], [g.fresh(out + "_q")], name=f"{node.name}_{op.lower()}_int8"
                                       ).output[0]
            elif average_pool_kind(g, node) and quantize_after(g, out) is None:
                q_out = g.fresh(out + "_q")
                make_qlinear_pool(g, node, x, x.scale, x.zero_point, q_out)
            else:
                continue
            g.remove(node)
            g.add_node("DequantizeLinear", [q_out, x.scale, x.zero_point], [out], name=node.name + "_dq")
            count += 1
            changed = True
    return count


def _integer_clip(g: Graph, node, x) -> list[tuple[str, int]] | None:
    """The Clip on ``x``'s integers (``[]``: it clips nothing they can hold), or None when a bound falls between
    grid points (clipping the floats would then give a value the integers cannot hold)."""
    bounds = clamp_bounds(g, node)
    if bounds is None:
        return None
    scale, zp = scalar(g, x.scale), g.const(x.zero_point)
    info = np.iinfo(zp.dtype)
    offset = int(zp.reshape(-1)[0])
    ops = []
    for op, bound, limit in (("Max", bounds[0], info.min), ("Min", bounds[1], info.max)):
        if bound is None:
            continue
        steps = bound / scale + offset
        if (op == "Max" and steps <= limit + 1e-4) or (op == "Min" and steps >= limit - 1e-4):
            continue  # beyond what the integers hold: nothing to clip
        if abs(steps - round(steps)) > 1e-4:
            return None
        ops.append((op, int(round(steps))))
    return ops
