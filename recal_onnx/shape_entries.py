"""A shape input's entries, known or computed, and rewriting some of them.

Exporters write the shape of a ``Reshape`` or ``Expand`` as a constant, or as a ``Concat`` of constants and sizes
read off tensors at run time. A pass that changes a size (heads removed) reads which entries are constants,
which follow the tensors by themselves, and sets the constants it must.
"""

from __future__ import annotations

import numpy as np

from .ir_edits import Graph, Node, Value


def shape_entries(g: Graph, node: Node, index: int) -> list[int | None] | None:
    """The entries of ``node``'s shape input ``index``: a constant, or a ``Concat`` of constants and dims computed at
    run time (``None``: read off a tensor's shape, so they follow thinning). None when it is neither."""
    parts = _shape_parts(g, node.inputs[index])
    return None if parts is None else [v for _, _, v in parts]


def _shape_parts(g: Graph, value: Value) -> list[tuple[int | None, int, int | None]] | None:
    """Per entry of a shape: ``(Concat input, offset in it, value)`` (input None: the shape is one constant)."""
    if g.is_const(value):
        return [(None, i, int(x)) for i, x in enumerate(np.ravel(g.const(value)))]
    node = _shape_concat(g, value)
    if node is None:
        return None
    out = []
    for index, part in enumerate(node.inputs):
        c = g.const(part)
        if c is not None:
            out += [(index, i, int(x)) for i, x in enumerate(np.ravel(c))]
            continue
        size = part.shape[0] if part.shape is not None and len(part.shape) == 1 else 1  # a dim read off a shape
        if not isinstance(size, int):
            return None
        out += [(index, i, None) for i in range(size)]
    return out


def _shape_concat(g: Graph, value: Value) -> Node | None:
    """The ``Concat`` that lists a computed shape's entries, through what exporters put after it: a flattening
    ``Reshape``, a ``Cast``, and torch's ``Where(Equal(s, -1), ones, s)`` for ``expand``'s -1."""
    node = g.producer(value)
    while node is not None and node.op_type != "Concat":
        if node.op_type == "Cast" or node.op_type == "Reshape" and list(np.ravel(g.const(node.inputs[1]))) == [-1]:
            node = g.producer(node.inputs[0])
        elif node.op_type == "Where" and (equal := g.producer(node.inputs[0])) is not None and \
                equal.op_type == "Equal" and equal.inputs[0] is node.inputs[2] and _minus_ones(g, equal.inputs[1]):
            node = g.producer(node.inputs[2])
        else:
            return None
    return node


def _minus_ones(g: Graph, value: Value) -> bool:
    """``value`` is all -1: a constant, or ``ConstantOfShape(.., 1) * -1`` (as torch writes it)."""
    if g.is_const(value):
        return bool((g.const(value) == -1).all())
    node = g.producer(value)
    if node is None or node.op_type != "Mul" or len(node.inputs) != 2:
        return False
    ones, minus = sorted(node.inputs, key=g.is_const)
    fill = g.producer(ones)
    return g.is_const(minus) and bool((g.const(minus) == -1).all()) and fill is not None and \
        fill.op_type == "ConstantOfShape" and "value" in fill.attributes and \
        bool((fill.attributes["value"].value.numpy() == 1).all())


def rewrite_shape(g: Graph, node: Node, index: int, values: dict[int, int]) -> None:
    """Set entries ``values`` (position: value) of ``node``'s shape input ``index``: a new constant, or a new
    ``Concat`` with new constant parts (the old one may have other readers)."""
    value = node.inputs[index]
    parts = _shape_parts(g, value)
    if g.is_const(value):
        shape = g.const(value).copy()
        for position, new in values.items():
            shape[position] = new
        node.replace_input_with(index, g.add_const(value.name, shape))
        return
    concat = _shape_concat(g, value)
    if concat is not g.producer(value) and any(v == -1 for _, _, v in parts):
        raise AssertionError("unreachable: a caller refuses a shape whose -1 it cannot rewrite")
    inputs = list(concat.inputs)
    for position, new in values.items():
        part, offset, _ = parts[position]
        array = g.const(inputs[part]).copy()
        array.reshape(-1)[offset] = new
        inputs[part] = g.add_const(concat.inputs[part].name, array)
    node.replace_input_with(index, g.add_node("Concat", inputs, axis=0).outputs[0])
