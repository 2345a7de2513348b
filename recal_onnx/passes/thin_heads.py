"""Remove dead attention heads: heads whose value rows and bias are zero, or whose columns of the output
projection are (the core's :func:`~recal_core.head_coupling.live_heads`), from an exported transformer::

    Before:  x -> MatMul(Wq[., 4*d]) -> Add(bq) -> Reshape([.., -1, d]) -> Transpose -> MatMul(Q, Kᵀ) -> ...
                  (K and V alike)      -> Softmax -> MatMul(P, V) -> Transpose -> Reshape([.., -1])
                  -> Q -> DQ -> MatMul(Wo[4*d, .])                          (head 2's Wv columns and bv zero)
    After:   the same with Wq, Wk, Wv [., 3*d], their biases [3*d] and Wo [3*d, .]

An attention is found from its ``Softmax``: the ``MatMul`` of queries and keys before it, the ``MatMul`` with
the values after it, and, through reshapes, transposes, scalar scales and scalar (de)quantization, the
``MatMul`` (+ bias ``Add``) layers that make the queries, keys and values and the one that reads the merged
heads. Every tensor on the way must be read only there, the head size must be a constant of the reshape that
splits the heads, and that reshape must infer the head count (``-1``) or hold it as a constant (rewritten);
an attention that does not pass is left as it is. Grouped-query attention is left as it is. Quantized weights
are sliced with their per-channel scales.
"""

from __future__ import annotations

import logging

import numpy as np

from recal_core.head_coupling import Attention, live_heads, unit_rows

from ..graph import Graph, Node, Value
from ..qdq import weight as weight_dq
from .thin_channels import _is_zero, _slice_weight, _weight

log = logging.getLogger(__name__)

_PLUMBING = {"Transpose", "Reshape", "Identity", "Cast"}
_SCALAR_OPS = {"Mul", "Div", "QuantizeLinear", "DequantizeLinear"}  # with a scalar constant


def thin_heads(g: Graph) -> int:
    """Remove the dead heads of every attention found; return how many went."""
    removed = 0
    for softmax in list(g.each("Softmax")):
        found = _attention(g, softmax)
        if found is None:
            continue
        att, layers, biases, splits = found
        keep = live_heads(att, lambda name: _canonical_zero(g, layers, biases, name))
        if keep.all():
            continue
        units = np.flatnonzero(keep)
        for weight, width in att.widths().items():
            node = layers[weight]
            _slice_weight(g, node, 1, unit_rows(units, width), 0 if weight == att.output else 1)
        for weight, key in att.biases:
            add = biases[key]
            slot = 0 if g.is_const(add.inputs[0]) else 1
            index = unit_rows(units, att.head_dim)
            const = add.inputs[slot]
            add.replace_input_with(slot, g.add_const(const.name, np.take(g.const(const), index, axis=-1)))
        for reshape, axis, per in splits:
            shape = g.const(reshape.inputs[1]).copy()
            if shape[axis] != -1:
                shape[axis] = len(units) * per
                reshape.replace_input_with(1, g.add_const(reshape.inputs[1].name, shape))
        removed += att.heads - len(units)
        log.info("thinned %s: %d -> %d heads", att.name, att.heads, len(units))
    return removed


def _canonical_zero(g: Graph, layers: dict[str, Node], biases: dict[str, Node], name: str) -> np.ndarray:
    """Elementwise "is zero" of a projection weight in ``[out, in]`` order (stored ``[in, out]``) or a bias."""
    if name in biases:
        add = biases[name]
        return g.const(next(i for i in add.inputs if g.is_const(i))) == 0
    return _is_zero(g, layers[name].inputs[1]).T


def _attention(g: Graph, softmax: Node):
    """The attention around ``softmax``: its record, its layers and bias Adds by name, and the reshapes
    that split heads with the head axis; None when it is not one this pass can thin."""
    qk = _scores_matmul(g, softmax.inputs[0])
    pv = _forward(g, softmax.outputs[0], {"Where", "Cast", "Dropout", "IsNaN"})
    if qk is None or qk.op_type != "MatMul" or pv is None or pv.op_type != "MatMul":
        return None
    sides = []
    for value in (qk.inputs[0], qk.inputs[1], pv.inputs[1]):
        side = _projection(g, value)
        if side is None:
            return None
        sides.append(side)
    merged, merges = _forward(g, pv.outputs[0], _PLUMBING | _SCALAR_OPS), []
    if merged is None or merged.op_type != "MatMul" or _weight(g, merged) is None:
        return None
    value = merged.inputs[0]
    while (node := g.producer(value)) is not None and node is not pv:  # the reshapes that merge heads back
        if node.op_type == "Reshape" and g.is_const(node.inputs[1]):
            merges.append(node)
        value = next(i for i in node.inputs if i is not None and not g.is_const(i))
    (q, qb, qs, d, qo), (k, kb, ks, _, ko), (v, vb, vs, _, vo) = sides
    if d is None or _weight(g, q)[0].shape[1] % d:
        return None
    heads, kv = _weight(g, q)[0].shape[1] // d, _weight(g, k)[0].shape[1] // d
    if any(heads in s or heads * d in s for s in (*qo, *ko, *vo)):
        return None  # a reshape between the split and the attention holds the head count
    if heads != kv or _weight(g, v)[0].shape[1] != heads * d or _weight(g, merged)[0].shape[0] != heads * d:
        return None  # grouped-query attention, or shapes this pass does not follow
    names = {"q": q.inputs[1].name, "k": k.inputs[1].name, "v": v.inputs[1].name, "o": merged.inputs[1].name}
    if len(set(names.values())) != 4:
        return None
    layers = {names[r]: n for r, n in zip("qkvo", (q, k, v, merged))}
    biases, pairs = {}, []
    for role, add in zip("qkv", (qb, kb, vb)):
        if add is not None:  # by the Add's output: exporters share one constant among equal biases
            biases[add.outputs[0].name] = add
            pairs.append((names[role], add.outputs[0].name))
    splits = [s for s in (qs, ks, vs) if s is not None]
    for reshape in merges:
        shape = g.const(reshape.inputs[1])
        if shape[-1] == heads * d:
            splits.append((reshape, len(shape) - 1, d))
        elif shape[-1] != -1:
            return None
    att = Attention(softmax.name or "attention", names["q"], names["k"], names["v"], names["o"], heads, heads, d,
                    tuple(pairs))
    return att, layers, biases, splits


def _scores_matmul(g: Graph, value: Value) -> Node | None:
    """The one ``MatMul`` of two computed tensors (queries by keys) a few masking / scaling ops above
    ``value``, the softmax's input."""
    found, stack, seen = [], [(value, 0)], set()
    while stack:
        v, depth = stack.pop()
        node = g.producer(v)
        if node is None or node.name in seen or depth > 6:
            continue
        seen.add(node.name)
        if node.op_type == "MatMul" and not any(g.is_const(i) or weight_dq(g, i) is not None for i in node.inputs):
            found.append(node)
        elif node.op_type in ("Add", "Where", "Mul", "Div", "Cast", "Sub"):
            stack.extend((i, depth + 1) for i in node.inputs if i is not None and not g.is_const(i))
    return found[0] if len(found) == 1 else None


def _readers(g: Graph, value: Value) -> list[Node]:
    """Who reads ``value``'s numbers: its consumers but ``Shape`` (the exporters read the head size off the
    queries' shape for the scale; the head size does not change)."""
    return [n for n in g.consumers(value) if n.op_type != "Shape"] + \
        [None] * sum(1 for o in g.graph.outputs if o is value)


def _forward(g: Graph, value: Value, through: set[str]) -> Node | None:
    """Down from ``value`` through single-reader ops of ``through``: the first node outside them."""
    while True:
        readers = _readers(g, value)
        if len(readers) == 2 and {getattr(r, "op_type", None) for r in readers} == {"IsNaN", "Where"}:
            readers = [r for r in readers if r.op_type == "Where"]  # softmax's NaN guard
        if len(readers) != 1 or readers[0] is None:
            return None
        node = readers[0]
        if node.op_type not in through:
            return node
        if node.op_type in _SCALAR_OPS and not all(g.is_const(i) and g.const(i).size == 1 for i in node.inputs[1:]
                                                    if i is not None):
            return None
        value = node.outputs[0]


def _projection(g: Graph, value: Value):
    """The ``MatMul`` layer (and its bias ``Add``) behind a query, key or value input, the reshape that splits
    its heads (the one nearest the layer: its node, head axis, and whether its shape is a constant), the head
    size, and the constant entries of the other reshapes on the way: None where the way is not plain."""
    reshapes = []
    while True:
        node = g.producer(value)
        if node is None or len(_readers(g, value)) != 1:
            return None
        if node.op_type == "Reshape":
            shape = g.const(node.inputs[1])
            reshapes.append((node, shape if shape is not None else _concat_shape(g, node.inputs[1])))
        elif node.op_type in _PLUMBING or (node.op_type in _SCALAR_OPS and all(
                g.is_const(i) and g.const(i).size == 1 for i in node.inputs[1:] if i is not None)):
            pass
        elif node.op_type == "Add":
            layer = g.producer(next((i for i in node.inputs if not g.is_const(i)), None))
            if layer is None or layer.op_type != "MatMul" or len(_readers(g, layer.outputs[0])) != 1:
                return None
            return _layer(g, layer, node, reshapes)
        elif node.op_type == "MatMul":
            return _layer(g, node, None, reshapes)
        else:
            return None
        value = next((i for i in node.inputs if i is not None and not g.is_const(i)), None)
        if value is None:
            return None


def _layer(g: Graph, layer: Node, bias: Node | None, reshapes):
    if _weight(g, layer) is None or not reshapes:
        return None
    split, shape = reshapes[-1]
    if shape is None or len(shape) < 3 or shape[-1] <= 0:
        return None
    const = g.is_const(split.inputs[1])
    if not const and shape[-2] != -1:
        return None  # a computed shape holding the head count: not rewritten
    others = [s for _, s in reshapes[:-1]]
    if any(s is None for s in others):
        return None
    return layer, bias, (split, len(shape) - 2, 1) if const else None, int(shape[-1]), others


def _concat_shape(g: Graph, value: Value) -> np.ndarray | None:
    """A reshape's shape made by ``Concat`` of computed dims and constants: the constants, with 0 for each
    computed dim (a dim read off a tensor's shape follows thinning)."""
    node = g.producer(value)
    if node is None or node.op_type != "Concat":
        return None
    parts = []
    for i in node.inputs:
        c = g.const(i)
        parts.append(np.zeros(1, np.int64) if c is None else np.asarray(c, np.int64).reshape(-1))
    return np.concatenate(parts)
