"""Remove dead attention heads: heads whose value rows and bias are zero, or whose columns of the output
projection are (the core's :func:`~recal_core.head_coupling.live_heads`), from an exported transformer::

    Before:  x -> MatMul(Wq[., 4*d]) -> Add(bq) -> Reshape([.., -1, d]) -> Transpose -> MatMul(Q, Kᵀ) -> ...
                  (K and V alike)      -> Softmax -> MatMul(P, V) -> Transpose -> Reshape([.., -1])
                  -> Q -> DQ -> MatMul(Wo[4*d, .])                          (head 2's Wv columns and bv zero)
    After:   the same with Wq, Wk, Wv [., 3*d], their biases [3*d] and Wo [3*d, .]

An attention is found from its ``Softmax``: the ``MatMul`` of queries and keys before it, the ``MatMul`` with
the values after it, and, through reshapes, transposes, scalar scales and scalar (de)quantization, rotary
embeddings (``x * cos + rotate_half(x) * sin``, within each head) and the repeat of grouped-query attention's
key/value heads (``Unsqueeze -> Expand -> Reshape``), the ``MatMul`` (+ bias ``Add``) layers that make the
queries, keys and values and the one that reads the merged heads. Every tensor on the way must be read only
there, the head size must be a constant of the reshape that splits the heads, and each shape on the way holds
the head count at the head axis as a constant (rewritten), ``-1``, or a value computed from the tensors' own
shapes (which follows); a packed projection (GPT-2's ``c_attn``: one ``MatMul``, its Q, K and V blocks taken by a
``Split`` of the last axis) loses a head's rows from each block, and the split's sizes follow; one packed per head
(GPT-NeoX's ``query_key_value``: the ``Split`` after the heads are, within each head's rows, and a partial rotary
embedding ending in a ``Concat``) loses each dead head's run of rows; a norm of each head's queries or keys over
its own last axis (Qwen3's ``q_norm``: ``Pow``, ``ReduceMean``, ... times its weight) is followed like a rotary
region, one before the heads are split is not; an attention that does not pass is left as it is, and where its
value layer has zero outputs the conversion warns, naming it and why. With grouped-query
attention a unit is a key/value head with its query heads (:mod:`recal_core.head_coupling`). Quantized weights are
sliced with their per-channel scales.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np

from recal_core.head_coupling import Attention, live_heads, unit_rows

from ..findings import Findings
from ..ir_edits import Graph, Node, Value, attr, input_of
from ..head_regions import PLUMBING, SCALAR_OPS, ends_region, head_local_region, region_keeps_heads, scalar_op
from ..shape_entries import rewrite_shape, shape_entries
from ..qdq import weight as weight_dq
from .matmul_to_nbits import grouped_weight
from .thin_channels import _is_zero, _slice_weight, _weight

log = logging.getLogger(__name__)

_REPEAT = {"Unsqueeze", "Expand"}  # grouped-query attention's repeat of key/value heads (with a Reshape)


@dataclass(frozen=True)
class _NotFollowed:
    """An attention (scores and values multiplied around a softmax) whose layout this pass cannot follow."""

    values: Node  # the MatMul of probabilities and values
    reason: str


def thin_heads(g: Graph, findings: Findings | None = None) -> int:
    """Remove the dead heads of every attention found; return how many went. An attention this pass cannot follow
    whose value layer has zero outputs (pruned heads, most likely) goes to ``findings.heads_kept`` with why."""
    removed = 0
    for softmax in list(g.each("Softmax")):
        found = _attention(g, softmax)
        if isinstance(found, _NotFollowed):
            zero = _zero_value_outputs(g, found.values)
            if zero and findings is not None:
                findings.heads_kept[softmax.name or found.values.name] = (
                    f"{zero} outputs of the layer making its values are zero, but {found.reason}")
            continue
        if found is None:
            continue
        att, layers, biases, splits = found
        keep = live_heads(att, lambda name: _canonical_zero(g, layers, biases, name))
        if keep.all():
            continue
        units = np.flatnonzero(keep)
        for weight, width in att.widths().items():
            node = layers[weight]
            _slice_weight(g, node, 1, unit_rows(units, width, att.kv_heads), 0 if weight == att.output else 1)
        for weight, key in att.biases:
            add = biases[key]
            slot = 0 if g.is_const(add.inputs[0]) else 1
            index = unit_rows(units, att.widths()[weight], att.kv_heads)
            const = add.inputs[slot]
            add.replace_input_with(slot, g.add_const(const.name, np.take(g.const(const), index, axis=-1)))
        shapes: dict[tuple[Node, int], dict[int, int]] = {}  # a shape read by two sides (K and V) is edited once
        for node, index, position, per in splits:
            shapes.setdefault((node, index), {})[position] = len(units) * per
        for (node, index), values in shapes.items():
            rewrite_shape(g, node, index, values)
        removed += att.heads - len(units) * att.per_unit
        log.info("thinned %s: %d -> %d heads", att.name, att.heads, len(units) * att.per_unit)
    return removed


def _zero_value_outputs(g: Graph, values: Node) -> int:
    """How many outputs of the weight layer above the values ``values`` multiplies are zero: columns of its
    ``[in, out]`` (de)quantized weight, or rows of a weight quantized in groups that reaches it transposed
    (:func:`~recal_onnx.passes.matmul_to_nbits.grouped_weight`); a computed or missing weight: 0."""
    value, node = values.inputs[1], None
    for _ in range(32):
        node = g.producer(value)
        if node is None or node.op_type == "MatMul":
            break
        value = next((i for i in node.inputs if i is not None and not g.is_const(i)), None)
        if value is None:
            return 0
    if node is None or node.op_type != "MatMul":
        return 0
    if _weight(g, node) is not None:
        return int(_is_zero(g, node.inputs[1]).all(axis=0).sum())
    transposed = g.producer(node.inputs[1])
    grouped = grouped_weight(g, transposed.inputs[0]) if transposed is not None and \
        transposed.op_type == "Transpose" and list(attr(transposed, "perm", [1, 0])) == [1, 0] else None
    return 0 if grouped is None else int((grouped.q == 0).all(axis=1).sum())


def _canonical_zero(g: Graph, layers: dict[str, Node], biases: dict[str, Node], name: str) -> np.ndarray:
    """Elementwise "is zero" of a projection weight in ``[out, in]`` order (stored ``[in, out]``) or a bias."""
    if name in biases:
        add = biases[name]
        return g.const(next(i for i in add.inputs if g.is_const(i))) == 0
    return _is_zero(g, layers[name].inputs[1]).T


def _attention(g: Graph, softmax: Node):
    """The attention around ``softmax``: its record, its layers and bias Adds by name, and the reshapes
    that split heads with the head axis; None when ``softmax`` is no attention's, :class:`_NotFollowed` when it is
    one this pass cannot thin."""
    qk = _scores_matmul(g, softmax.inputs[0])
    pv = _forward(g, softmax.outputs[0], {"Where", "Cast", "Dropout", "IsNaN"})
    if qk is None or qk.op_type != "MatMul" or pv is None or pv.op_type != "MatMul":
        return None
    sides = []
    for role, value in zip(("queries", "keys", "values"), (qk.inputs[0], qk.inputs[1], pv.inputs[1])):
        side = _projection(g, value)
        if side is None:
            return _NotFollowed(pv, f"its {role} do not come from one MatMul layer through reshapes, transposes, "
                                    "scalar ops, a rotary embedding or a per-head norm")
        sides.append(side)
    merged, merges = _forward(g, pv.outputs[0], PLUMBING | SCALAR_OPS), []
    if merged is None or merged.op_type != "MatMul" or _weight(g, merged) is None:
        return _NotFollowed(pv, "its merged heads are not read by one MatMul layer")
    value = merged.inputs[0]
    while (node := g.producer(value)) is not None and node is not pv:  # the reshapes that merge heads back
        if node.op_type == "Reshape" and g.is_const(node.inputs[1]):
            merges.append(node)
        value = next(i for i in node.inputs if i is not None and not g.is_const(i))
    (q, qb, q_split, d, _), (k, kb, k_split, _, _), (v, vb, v_split, _, _) = sides
    found = _blocks(g, [(side[0], side[4]) for side in sides], d)
    if d is None or found is None:
        return _NotFollowed(pv, "its head size is not a constant of the reshape that splits the heads, or a packed "
                                "projection's blocks are not one Split of its last axis")
    blocks, interleaved = found
    if interleaved:  # per head (GPT-NeoX): the reshape's last axis holds one head's Q, K and V of d rows each
        d = blocks[1][1]
        heads = kv = int(_weight(g, q)[0].shape[1]) // sum(rows for _, rows in blocks)
        if any(rows != d for _, rows in blocks) or _weight(g, merged)[0].shape[0] != heads * d:
            return _NotFollowed(pv, "its projection packs Q, K and V per key/value group (Falcon's layout)")
    else:
        if any(rows % d for _, rows in blocks):
            return _NotFollowed(pv, "its projections' sizes are not whole heads")
        (_, q_rows), (_, k_rows), (_, v_rows) = blocks
        heads, kv = q_rows // d, k_rows // d
        if heads % kv or v_rows != kv * d or _weight(g, merged)[0].shape[0] != heads * d:
            return _NotFollowed(pv, "its projections' sizes are not whole heads")
    names = {"q": q.inputs[1].name, "k": k.inputs[1].name, "v": v.inputs[1].name, "o": merged.inputs[1].name}
    if len(set(names.values())) != (2 if q is k is v else 4):
        return _NotFollowed(pv, "its projections share a weight")
    per_unit = (heads // kv, 1, 1)  # heads of Q, K and V a unit holds
    splits = []
    packed = sides[0][4][0] if q is k is v else None  # the Split that takes a packed layer's blocks
    if packed is not None and input_of(packed, 1) is not None and not interleaved:  # (sizes given; equal parts
        splits += [(packed, 1, side[4][1], per * d) for side, per in zip(sides, per_unit)]  # follow by themselves)
    for role, (reshape, steps), per in zip(("queries", "keys", "values"), (q_split, k_split, v_split), per_unit):
        edits = _follow_heads(g, reshape, steps, kv, per, heads // kv)
        if edits is None:
            return _NotFollowed(pv, f"a shape on the way from its {role}' projection does not hold the head count "
                                    "as a constant, -1 or a size computed from the tensors' own shapes")
        splits += edits
    layers = {names[r]: n for r, n in zip("qkvo", (q, k, v, merged))}
    biases, pairs = {}, []
    for role, add in zip("qkv", (qb, kb, vb)):
        if add is not None and add.outputs[0].name not in biases:  # by the Add's output: exporters share one
            biases[add.outputs[0].name] = add  # constant among equal biases (a packed layer has one Add)
            pairs.append((names[role], add.outputs[0].name))
    for reshape in merges:
        shape = g.const(reshape.inputs[1])
        if shape[-1] == heads * d:
            splits.append((reshape, 1, len(shape) - 1, heads // kv * d))
        elif len(shape) == 4 and shape[1] == heads and shape[-1] == d:  # [batch, heads, tokens, d] back from
            splits.append((reshape, 1, 1, heads // kv))  # the heads merged into the batch
        elif shape[-1] != -1:
            return _NotFollowed(pv, f"the reshape {reshape.name!r} that merges its heads has a shape this pass does "
                                    "not follow")
    att = Attention(softmax.name or "attention", names["q"], names["k"], names["v"], names["o"], heads, kv, d,
                    tuple(pairs), offsets=tuple(start for start, _ in blocks), interleaved=interleaved)
    if q is k is v and (problem := att.packing_problem({names["q"]: _weight(g, q)[0].shape[1]})) is not None:
        return _NotFollowed(pv, problem)
    return att, layers, biases, splits


def _blocks(g: Graph, sides: list[tuple[Node, tuple | None]], span: int | None
            ) -> tuple[list[tuple[int, int]], bool] | None:
    """``(first row, rows)`` of the query, key and value in their layers' weights (``sides``: each layer with the
    ``(Split, output)`` of its block or None): whole weights, or, for one packed layer, the blocks its ``Split``
    outputs take (sizes given, or equal parts) of the whole weight (GPT-2), or of each head's ``span`` rows after
    the heads are split (GPT-NeoX: then the rows are within a head, and the flag is True). None for any other."""
    layers, splits = [n for n, _ in sides], [s for _, s in sides]
    if not any(splits):
        return [(0, int(_weight(g, n)[0].shape[1])) for n in layers], False
    if any(s is None for s in splits) or len({id(n) for n in layers}) != 1 or len({id(s[0]) for s in splits}) != 1:
        return None
    split, total = splits[0][0], int(_weight(g, layers[0])[0].shape[1])
    per_head = span is not None and g.rank(split.inputs[0]) == 4 and total % span == 0 and span < total
    whole = span if per_head else total
    sizes = g.const(input_of(split, 1)) if input_of(split, 1) is not None else \
        [whole // len(split.outputs)] * len(split.outputs)
    sizes = None if sizes is None else [int(x) for x in np.ravel(sizes)]
    if sizes is None or sum(sizes) != whole:
        return None
    return [(sum(sizes[:index]), sizes[index]) for _, index in splits], per_head


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
        if node.op_type in SCALAR_OPS and not all(g.is_const(i) and g.const(i).size == 1 for i in node.inputs[1:]
                                                    if i is not None):
            return None
        value = node.outputs[0]


def _projection(g: Graph, value: Value):
    """The ``MatMul`` layer (and its bias ``Add``) behind a query, key or value input, the reshape that splits
    its heads with the steps from there to the attention (nodes, and head-local regions as ``(end, region)``), and
    the head size, and for a packed projection (GPT-2's ``c_attn``) the ``(Split, output)`` that takes its block:
    None where the way is not plain."""
    steps: list = []
    block = None
    while True:
        node = g.producer(value)
        if node is None:
            return None
        readers = _readers(g, value)
        if steps and isinstance(steps[-1], tuple) and set(readers) <= steps[-1][1]:
            readers = readers[:1]  # a head-local region's input: read by its nodes alone
        if len(readers) != 1:
            return None
        if ends_region(g, node):
            region = head_local_region(g, node)
            if region is None:
                return None
            steps.append((node, region[1]))
            value = region[0]
            continue
        if node.op_type == "Add":
            layer = g.producer(next((i for i in node.inputs if not g.is_const(i)), None))
            if layer is None or layer.op_type != "MatMul" or len(_readers(g, layer.outputs[0])) != 1:
                return None
            return _layer(g, layer, node, steps, block)
        if node.op_type == "MatMul":
            return _layer(g, node, None, steps, block)
        if node.op_type == "Split" and block is None:
            rank = g.rank(node.inputs[0])
            if rank is None or int(attr(node, "axis", 0)) % rank != rank - 1:
                return None  # blocks of a packed projection are split off its last axis
            block = (node, list(node.outputs).index(value))
            value = node.inputs[0]
            continue
        if not (node.op_type in PLUMBING | _REPEAT or scalar_op(g, node) or
                node.op_type == "Concat" and len(node.inputs) == 1):
            return None
        steps.append(node)
        value = next((i for i in node.inputs if i is not None and not g.is_const(i)), None)
        if value is None:
            return None


def _follow_heads(g: Graph, split: Node, steps: list, units: int, per: int, per_unit: int):
    """The edits ``(node, input, position, per)`` that keep each shape from the reshape ``split`` down to the
    attention right once units go (``position`` then holds ``units * per``): the head axis followed through
    transposes, head-local regions, a key/value repeat (``per`` becomes ``per_unit``) and a merge of the heads into the
    batch; None where a shape holds the head count in a way this pass does not follow."""
    entries = shape_entries(g, split, 1)
    rank, axis, repeat, edits = len(entries), len(entries) - 2, None, []
    if entries[axis] not in (-1, units * per):
        return None
    edits += [(split, 1, axis, per)] if entries[axis] == units * per else []
    for step in steps:
        if isinstance(step, tuple):
            if axis is None or not region_keeps_heads(g, step[1], rank, axis):
                return None
            for node in step[1]:  # a pair rotation's reshape back to [.., heads, d] holds the head count
                shape = shape_entries(g, node, 1) if node.op_type == "Reshape" else None
                if node.op_type == "Reshape" and (shape is None or len(shape) != rank or
                                                  shape[axis] not in (-1, None, units * per)):
                    return None
                edits += [(node, 1, axis, per)] if shape is not None and shape[axis] == units * per else []
            continue
        op = step.op_type
        if op == "Transpose":
            perm = list(attr(step, "perm") or range(rank)[::-1])
            if axis is None and perm[0] != 0:
                return None
            axis = perm.index(axis) if axis is not None else None
        elif op == "Unsqueeze" and axis is not None:
            added = g.const(input_of(step, 1)) if input_of(step, 1) is not None else attr(step, "axes")
            if added is None:
                return None
            rank += np.size(added)
            for a in sorted(int(x) % rank for x in np.ravel(added)):
                axis += a <= axis
                repeat = a if a == axis + 1 else repeat
        elif op == "Expand" and axis is not None:
            shape = shape_entries(g, step, 1)
            at = axis - (rank - len(shape)) if shape is not None else -1
            if shape is None or len(shape) > rank or at >= 0 and shape[at] not in (1, None, units * per):
                return None
            edits += [(step, 1, at, per)] if at >= 0 and shape[at] == units * per else []
        elif op == "Reshape":
            shape = shape_entries(g, step, 1)
            if shape is None:
                return None
            if axis is not None and repeat == axis + 1 and len(shape) == rank - 1:  # the repeat merged
                per, repeat = per_unit, None
            elif axis == 1 and len(shape) == rank - 1 and shape[0] in (-1, None):
                axis = None  # heads merged into the batch: later shapes read their sizes off the tensors
            elif axis is None and shape[0] not in (-1, None) or axis is not None and len(shape) != rank:
                return None
            rank = len(shape)
            if axis is not None and shape[axis] not in (-1, None, units * per):
                return None
            edits += [(step, 1, axis, per)] if axis is not None and shape[axis] == units * per else []
        elif op in _REPEAT:
            return None
    return edits


def _layer(g: Graph, layer: Node, bias: Node | None, steps: list, block=None):
    """The layer, its bias, the reshape splitting its heads (the one nearest the layer) with the steps after it,
    the head size, and the block of a packed layer; None without a constant head size."""
    if _weight(g, layer) is None:
        return None
    at = next((i for i in range(len(steps) - 1, -1, -1) if not isinstance(steps[i], tuple)
               and steps[i].op_type == "Reshape"), None)
    if at is None or any(isinstance(step, tuple) for step in steps[at + 1:]):
        return None  # (a region before the heads are split mixes them: OLMo 2's norm of all queries together)
    split = steps[at]
    entries = shape_entries(g, split, 1)
    if entries is None or len(entries) < 3 or entries[-1] is None or entries[-1] <= 0:
        return None
    return layer, bias, (split, steps[:at][::-1]), entries[-1], block
