"""Which rows of its projection each head of an attention reads, found by running the ops between them on row
numbers rather than by matching how a model happens to split its heads.

The projection's output is replaced by its row index (each element holds the row of the weight it comes
from), and the ops on the way to ``scaled_dot_product_attention`` run on that: views, transposes, splits,
slices, selects, indexing and repeats move the numbers as they move the values; a head-local elementwise op
(a rotary embedding's products and sums, a fake quantizer, a cast) passes them on unchanged. What arrives is
each head's rows, whatever the layout: Q, K and V as blocks (GPT-2's ``c_attn``), per head (GPT-NeoX's
``query_key_value``), per key/value group (Falcon), repeated for grouped-query attention.
"""

from __future__ import annotations

import operator
from typing import Any

import numpy as np
import torch

_aten = torch.ops.aten
# ops that only move elements: run as they are on the row numbers
_MOVES = {_aten.view.default, _aten.reshape.default, _aten._unsafe_view.default, _aten.transpose.int,
          _aten.permute.default, _aten.contiguous.default, _aten.clone.default, _aten.alias.default,
          _aten.unsqueeze.default, _aten.squeeze.dim, _aten.expand.default, _aten.slice.Tensor, _aten.select.int,
          _aten.split.Tensor, _aten.split_with_sizes.default, _aten.chunk.default, _aten.flatten.using_ints,
          _aten.index.Tensor, _aten.cat.default, _aten.detach.default, _aten.squeeze.dims, _aten.unbind.int,
          _aten.unflatten.int, _aten.repeat.default, _aten.repeat_interleave.self_int, _aten.narrow.default,
          _aten.broadcast_to.default, _aten.expand_as.default, _aten.stack.default,
          operator.getitem}
# elementwise ops that keep a head's values in its head: the row numbers pass through
_KEEPS = {_aten.mul.Tensor, _aten.add.Tensor, _aten.sub.Tensor, _aten.div.Tensor, _aten.neg.default,
          _aten.pow.Tensor_Scalar, _aten.rsqrt.default, _aten.sqrt.default, _aten.reciprocal.default,
          _aten.add.Scalar, _aten.mul.Scalar, _aten.div.Scalar, _aten.clamp.default,
          _aten._to_copy.default, _aten.to.dtype, _aten.type_as.default,
          _aten.fake_quantize_per_channel_affine.default, _aten.fake_quantize_per_tensor_affine.default,
          _aten.fake_quantize_per_tensor_affine.tensor_qparams}


# reductions over the last axis, kept (a per-head norm of queries and keys, Qwen3's and Gemma 3's q_norm): the
# rows they mix must turn out to be one head's
_REDUCES = {_aten.mean.dim, _aten.sum.dim_IntList, _aten.amax.default, _aten.var.correction,
            _aten.linalg_vector_norm.default}
_CONSTANT_COPIES = {_aten.lift_fresh_copy.default, _aten.clone.default, _aten.detach.default,
                    _aten._to_copy.default}
_MISSING = object()


class NotFollowedError(Exception):
    """An op on the way whose effect on the rows recal cannot run: ``node``, and ``why`` (empty, or ``": ..."``)."""

    def __init__(self, node: torch.fx.Node, why: str = ""):
        super().__init__(f"{node.name} ({node.target}){why}")
        self.node, self.why = node, why


def head_rows(linear: torch.fx.Node, path: list[torch.fx.Node], target: torch.fx.Node,
              constants: dict[str, torch.Tensor], transposed: bool = False) -> np.ndarray:
    """``[heads, head_dim]``: the rows of ``linear``'s weight that each head of ``target`` (an attention's
    input, ``[batch, heads, tokens, head_dim]``, or ``[batch * heads, tokens, head_dim]``; ``transposed``: its last
    two axes swapped, a key as ``kᵀ``) is computed from, running ``path`` (the ops between them, in graph order).
    ``constants``: the values of lifted tensor constants (index tensors). Raises :class:`NotFollowedError` for an op
    that mixes rows in a way that is not a head's own."""
    shape = _shape(linear)
    if shape is None:
        raise NotFollowedError(linear, ": it has no recorded shape")
    values: dict[torch.fx.Node, Any] = {linear: torch.arange(shape[-1], dtype=torch.float64).expand(shape)}
    mixed: list[tuple[torch.fx.Node, torch.Tensor]] = []  # (a reduction, the rows it mixes along its last axis)
    for node in path:
        if node.target in _REDUCES and isinstance(values.get(node.args[0]), torch.Tensor):
            values[node] = _reduce(node, values[node.args[0]])
            mixed.append((node, values[node.args[0]]))
        else:
            values[node] = _run(node, values, constants)
    rows = values.get(target)
    if isinstance(rows, torch.Tensor) and transposed and rows.dim() >= 2:
        rows = rows.transpose(-1, -2)
    if isinstance(rows, torch.Tensor) and rows.dim() == 3:
        rows = _heads_of_merged_batch(rows)
    if not isinstance(rows, torch.Tensor) or rows.dim() != 4:
        raise NotFollowedError(target, ": not reached as one [batch, heads, tokens, head size] tensor")
    if not (rows == rows[:1, :, :1]).all():
        raise NotFollowedError(target, ": its heads read different rows at different tokens")
    heads = rows[0, :, 0]
    for node, reduced in mixed:
        if not _within_heads(reduced, heads):
            raise NotFollowedError(node, ": it mixes the rows of more than one head")
    return heads.numpy().astype(np.int64)


def _reduce(node: torch.fx.Node, rows: torch.Tensor) -> torch.Tensor:
    """A reduction over the last axis, kept: one of the rows it mixes stands for them (checked at the end)."""
    dims = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    keep = node.args[2] if len(node.args) > 2 and isinstance(node.args[2], bool) else node.kwargs.get("keepdim", False)
    dims = [dims] if isinstance(dims, int) else list(dims or ())
    if [d % rows.dim() for d in dims] != [rows.dim() - 1] or not keep:
        raise NotFollowedError(node, ": a reduction recal follows only over the last axis, kept")
    return rows[..., :1]


def _within_heads(reduced: torch.Tensor, heads: torch.Tensor) -> bool:
    """Each vector along ``reduced``'s last axis holds rows of one head (of ``heads``, ``[heads, d]``)."""
    head_of = {int(r): h for h, row in enumerate(heads) for r in row.tolist()}
    for vector in torch.unique(reduced.reshape(-1, reduced.shape[-1]), dim=0):  # (each token's vectors are alike)
        owners = {head_of.get(int(r)) for r in vector.tolist()}
        if len(owners) != 1 or None in owners:
            return False
    return True


def _heads_of_merged_batch(rows: torch.Tensor) -> torch.Tensor | None:
    """``[batch * heads, tokens, d]`` (heads within each batch entry) as ``[1, heads, tokens, d]``: the rows repeat
    from one batch entry to the next, so the heads are the shortest period that divides the first axis."""
    n = rows.shape[0]
    for heads in (p for p in range(1, n + 1) if n % p == 0):
        if torch.equal(rows, rows[:heads].repeat(n // heads, 1, 1)):
            return rows[:heads].unsqueeze(0)
    return None


def _run(node: torch.fx.Node, values: dict, constants: dict[str, torch.Tensor]):
    def value(a):
        if isinstance(a, torch.fx.Node):
            if a in values:
                return values[a]
            if a.name in constants:
                return constants[a.name]
            if a.target in _CONSTANT_COPIES and a.args and isinstance(a.args[0], torch.fx.Node) \
                    and a.args[0].name in constants:
                return constants[a.args[0].name]  # an index list written in the model's code
            return _MISSING  # a tensor not from the projection (cos and sin tables, a mask)
        if isinstance(a, (list, tuple)):
            return type(a)(value(x) for x in a)
        return a

    args, kwargs = value(node.args), {k: value(v) for k, v in node.kwargs.items()}
    if node.target in _MOVES:
        if _holes(args) or _holes(kwargs):
            raise NotFollowedError(node, ": it moves a tensor that is not from the projection with it")
        return node.target(*args, **kwargs)
    if node.target in _KEEPS:
        rows = [values[a] for a in node.all_input_nodes if a in values]
        out = _shape(node)
        if not rows or out is None:
            raise NotFollowedError(node)
        first = max(rows, key=lambda t: t.shape[-1])
        for other in rows:  # q * cos + rotate_half(q) * sin: the same rows of each head, in another order; x times
            if other.shape[-1] == 1 and first.shape[-1] > 1:  # its norm: one row of each position's vector
                if not (first == other).any(-1).all():
                    raise NotFollowedError(node, ": it combines different rows")
            elif other.shape != first.shape or not torch.equal(other.sort(-1).values, first.sort(-1).values):
                raise NotFollowedError(node, ": it combines different rows")
        return first.expand(out) if tuple(first.shape) != out else first
    raise NotFollowedError(node)


def _holes(args) -> bool:
    if isinstance(args, dict):
        return any(_holes(v) for v in args.values())
    if isinstance(args, (list, tuple)):
        return any(_holes(a) for a in args)
    return args is _MISSING


def _shape(node: torch.fx.Node) -> tuple[int, ...] | None:
    val = node.meta.get("val")
    return tuple(val.shape) if isinstance(val, torch.Tensor) else None
