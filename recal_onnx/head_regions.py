"""What works within each attention head, so that removing a head leaves the others as they were: a rotary
embedding (``x * cos + rotate_half(x) * sin``, partial or whole, GPT-J's rotation of channel pairs) and a norm of
each head's queries or keys (Qwen3's ``q_norm``). :mod:`recal_onnx.passes.thin_heads` follows the heads through
such a region as through a transpose.
"""

from __future__ import annotations

import numpy as np

from .ir_edits import Graph, Node, Value, attr, input_of
from .qdq import weight as weight_dq

PLUMBING = {"Transpose", "Reshape", "Identity", "Cast"}
SCALAR_OPS = {"Mul", "Div", "QuantizeLinear", "DequantizeLinear"}  # with a scalar constant


def ends_region(g: Graph, node: Node) -> bool:
    """Where a head-local region ends: a rotary embedding's ``Add`` (or, partial, its ``Concat``) of two computed
    tensors, or a per-head norm's ``Mul`` by its weight."""
    constants = [g.is_const(i) for i in node.inputs]
    if node.op_type == "Mul":
        return any(constants) and not scalar_op(g, node)
    return (node.op_type == "Add" or node.op_type == "Concat" and len(node.inputs) > 1) and not any(constants)


# a head-local region: a rotary embedding's ops, and a norm's over each head's last axis (Qwen3's q_norm)
_REGION_OPS = {"Mul", "Add", "Sub", "Neg", "Slice", "Concat", "Cast", "Pow", "ReduceMean", "Sqrt", "Reciprocal", "Div"}


def scalar_op(g: Graph, node: Node) -> bool:
    """A multiply, divide or (de)quantization by one constant number: it acts on every head alike."""
    return node.op_type in SCALAR_OPS and all(g.is_const(i) and g.const(i).size == 1 for i in node.inputs[1:]
                                               if i is not None)


def head_local_region(g: Graph, end: Node) -> tuple[Value, set[Node]] | None:
    """A rotary embedding (``x * cos + rotate_half(x) * sin``, or GPT-J's rotation of each pair of a head's
    channels: ``stack(-x[..., 1::2], x[..., ::2], -1)`` flattened back) or a per-head norm ending in ``end``: its one
    input ``x`` (made by a transpose, reshape or a per-head Split) and its nodes; cos, sin and a norm's weight are
    constants, ``Unsqueeze`` outputs, or values computed without a weight layer (checked to be one value for every
    head by :func:`region_keeps_heads`). None for anything else."""
    region, starts, stack = set(), set(), [end]
    while stack:
        node = stack.pop()
        if node in region:
            continue
        if len(region) >= 24:
            return None
        region.add(node)
        for value in node.inputs[:1] if node.op_type == "Slice" else node.inputs:
            producer = g.producer(value)
            pairs = _pair_rotation(g, producer)
            if pairs:
                region.update(pairs)
                stack.extend(g.producer(u.inputs[0]) for u in pairs[2:])
                continue
            if value is None or g.is_const(value) or producer is not None and producer.op_type == "Unsqueeze" \
                    or node.op_type in ("Mul", "Add") and without_weights(g, value):
                continue  # a number, cos or sin
            if producer is not None and producer.op_type in _REGION_OPS:
                stack.append(producer)
            elif producer is not None and (producer.op_type in PLUMBING or producer.op_type == "Split"):
                starts.add(value)  # (a Split: a per-head packed projection's block, GPT-NeoX's)
            else:
                return None
    return (starts.pop(), region) if len(starts) == 1 else None


def _pair_rotation(g: Graph, node: Node | None) -> list[Node] | None:
    """``[Reshape, Concat, Unsqueeze, ...]`` where ``node`` is the ``Reshape`` that flattens a ``Concat`` of
    ``Unsqueeze``d halves back into a head's channels (GPT-J's ``rotate_every_two``); None otherwise."""
    if node is None or node.op_type != "Reshape" or (concat := g.producer(node.inputs[0])) is None or \
            concat.op_type != "Concat":
        return None
    halves = [g.producer(v) for v in concat.inputs]
    if len(halves) < 2 or any(h is None or h.op_type != "Unsqueeze" or g.producer(h.inputs[0]) is None
                              or g.producer(h.inputs[0]).op_type not in _REGION_OPS for h in halves):
        return None
    return [node, concat, *halves]


def without_weights(g: Graph, value: Value, limit: int = 32) -> bool:
    """``value`` is computed without any weight layer's output (cos and sin from positions): within ``limit``
    nodes up, no ``MatMul`` or ``Gemm`` reads a weight."""
    stack, seen = [value], set()
    while stack:
        node = g.producer(stack.pop())
        if node is None or node.name in seen:
            continue
        seen.add(node.name)
        if len(seen) > limit or node.op_type in ("MatMul", "Gemm") and (
                g.is_const(node.inputs[1]) or weight_dq(g, node.inputs[1]) is not None):
            return False
        stack.extend(i for i in node.inputs if i is not None and not g.is_const(i))
    return True


def region_keeps_heads(g: Graph, region: set[Node], rank: int, axis: int) -> bool:
    """A rotary region (or a norm of each head's queries) works within each head: its slices, concats and means are
    on the last axis (not the heads'), and what it multiplies by (cos, sin, a norm's weight) is one value for every
    head (a constant of size 1 there, or unsqueezed there)."""
    paired = {n for n in region if n.op_type == "Unsqueeze"}  # a pair rotation's halves, one axis added at the end
    for node in region:
        if node.op_type in ("Slice", "ReduceMean"):
            position = 3 if node.op_type == "Slice" else 1
            axes = g.const(input_of(node, position)) if input_of(node, position) is not None else attr(node, "axes")
            if axes is None or [int(a) % rank for a in np.ravel(axes)] != [rank - 1] or axis == rank - 1:
                return False
        elif node.op_type == "Unsqueeze":
            added = g.const(input_of(node, 1)) if input_of(node, 1) is not None else attr(node, "axes")
            if added is None or [int(a) % (rank + 1) for a in np.ravel(added)] != [rank]:
                return False
        elif node.op_type == "Concat":
            width = rank + 1 if any(g.producer(v) in paired for v in node.inputs) else rank
            if int(attr(node, "axis")) % width != width - 1:
                return False
        if node.op_type == "Reshape":
            continue  # (a pair rotation's: its shape is checked, and rewritten, where the heads are followed)
        for value in node.inputs[:1] if node.op_type == "Slice" else node.inputs:
            producer = g.producer(value)
            if g.is_const(value):
                shape = g.const(value).shape
                if len(shape) > rank - axis and shape[len(shape) - rank + axis] != 1:
                    return False
            elif producer is not None and producer.op_type == "Unsqueeze" and producer not in paired:
                added = g.const(input_of(producer, 1))
                if added is None or axis not in [int(a) % rank for a in np.ravel(added)]:
                    return False
            elif producer not in region and node.op_type in ("Mul", "Add") and without_weights(g, value):
                shape = value.shape  # cos or sin computed: one value for every head where it broadcasts
                if shape is None or len(shape) > rank - axis and shape[len(shape) - rank + axis] != 1:
                    return False
    return True
