"""recal's pruning masks as variables and ops, updated at step ``k`` inside the train step.

Shared by the ``tf.compat.v1`` graph API (:mod:`recal_tf.graph`) and Keras (:mod:`recal_keras`, on every
backend): every per-step value (mask update points, exact zero counts, whether a mask is in force) is tabulated
from the core's :class:`~recal_core.model_plan.ModelPlan` and looked up with ``k``, so a graph, a
``tf.function``, an XLA-compiled or a JAX-jitted train step applies the same masks without a host call. The ops
come from an adapter (:mod:`recal_keras.tensor_ops`): TensorFlow's, or ``keras.ops`` on JAX and PyTorch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from recal_core.mask_layout import MaskLayout
from recal_core.model_plan import ModelPlan

from .tensor_ops import TensorFlowOps


@dataclass
class _Mask:
    """One variable's mask under one pruning modifier; ``counts[j]``: zeros at the modifier's update j."""

    name: str
    variable: object
    mask: object
    counts: list[int]
    layout: MaskLayout | None = None  # a structured mask: counts are groups (N:M: weights per run)
    kernel_axes: tuple[int, ...] | None = None  # the variable's axes in canonical [out, in, *spatial] order


@dataclass
class _ChannelGroup:
    """Masks (indices into their modifier's ``masks``) that prune the same channels, ranked together, and
    the per-channel variables zeroed with a pruned filter (:mod:`recal_core.channel_coupling`)."""

    kind: str  # "filter" | "channel"
    members: list[int]
    followers: list
    counts: list[int]  # channels zeroed at the modifier's update j (the core's ModelPlan.channel_count)


def per_step(value, total_steps: int) -> np.ndarray:
    """``value(k)`` for every step ``0..total_steps`` as float64 (None as NaN), without a Python list."""
    return np.fromiter((np.nan if v is None else v for v in map(value, range(total_steps + 1))), dtype=np.float64,
                       count=total_steps + 1)


@dataclass
class _MaskGroup:
    """One pruning modifier's masks, updated together, with its per-step tables."""

    constant: bool
    global_: bool  # one magnitude ranking across all the group's variables (global_sparsity)
    update_id: object  # variable: the update point the masks were computed at (-1: never)
    update_ids: np.ndarray  # per step: the last update point <= k (-1 before the first)
    in_force: np.ndarray  # per step: whether the masks are enforced
    masks: list[_Mask]
    channel_groups: list[_ChannelGroup] = field(default_factory=list)


def _shape(x) -> list[int]:
    return [int(d) for d in x.shape]


class PruningMasks:
    """Every pruning modifier's masks over a model's variables, with the ops that update and apply them.

    ``by_name``: the core's parameter name -> its variable; ``make_variable(name, shape, dtype, initial)``:
    creates one of recal's own (non-trainable) variables; ``lookup(name)``: a variable by name (the per-channel
    followers of a filter group); ``ops``: the tensor ops (:class:`recal_keras.tensor_ops.TensorFlowOps` by default).
    """

    def __init__(self, plan: ModelPlan, by_name: dict, kernel_axes: dict, make_variable: Callable,
                 lookup: Callable[[str], object], ops=None):
        self.o = o = ops if ops is not None else TensorFlowOps()
        self.groups: list[_MaskGroup] = []
        self.pruned: dict[str, object] = {}
        total = plan.schedule.total_steps
        for ps in plan.schedule.pruning:
            update_ids, in_force, update_steps = ps.tables(total)
            scope = f"recal/pruning_{ps.index}"
            group = _MaskGroup(ps.constant, bool(getattr(ps.modifier, "global_sparsity", False)),
                               make_variable(f"{scope}/update_id", [], o.index_dtype, -1), update_ids, in_force, [])
            for name in plan.prune_targets[ps.index]:
                variable = by_name[name]
                mask = make_variable(f"{scope}/masks/{name}", _shape(variable), o.dtype_of(variable), 1)
                counts = [plan.global_zeros(ps.index, u) if group.global_ else plan.masks[name].count(ps, u) or 0
                          for u in update_steps]
                group.masks.append(_Mask(name, variable, mask, counts, plan.masks[name].layouts.get(ps.index),
                                         kernel_axes.get(name)))
            names = [m.name for m in group.masks]
            group.channel_groups = [
                _ChannelGroup(g.kind, [names.index(n) for n in g.members], [lookup(f) for f in g.followers],
                              [plan.channel_count(g, u) for u in update_steps] or [0])
                for g in plan.channel_groups if g.modifier == ps.index]
            self.groups.append(group)
        for name in plan.masks:
            self.pruned[name] = by_name[name]

    def _assign(self, ops: list, variable, value) -> None:
        op = self.o.assign(variable, value)
        if op is not None:
            ops.append(op)

    def ops(self, k) -> list:
        """Per pruning modifier one conditional update of all its masks, then ``w <- 0 where mask == 0`` per
        variable."""
        return self.ops_and_factors(k)[0]

    def ops_and_factors(self, k) -> tuple[list, dict]:
        """:meth:`ops`, and per pruned variable the product of the masks in force at ``k`` (to mask optimizer
        state with, without reading the masks again).

        New masks rank (and ConstantKS reads) the weights with the masks of step ``k - 1`` applied,
        as the core's :mod:`recal_core.model_plan` says, so a weight pruned earlier (and moved by the
        optimizer since) is never ranked back in. Between updates a step costs one select and two multiplies
        per pruned variable: the ranking input is computed only inside the update branch.
        """
        o = self.o
        previous = o.maximum(k - 1, 0)
        weights = {name: o.read(variable) for name, variable in self.pruned.items()}
        old: dict[str, list] = {}
        for group in self.groups:
            was_in_force = o.take(o.constant(group.in_force), previous)
            for m in group.masks:
                # the step just taken ran under the masks of k - 1: they apply to its result even where a
                # modifier ends at k (as recal_torch applies its masks after the optimizer step)
                old.setdefault(m.name, []).append(o.pick(was_in_force, o.read(m.mask), self._one(m.mask)))

        def masked(name: str):  # called inside an update branch only
            return zeroed(weights[name], old[name], o)

        ops, now = [], {}
        for group in self.groups:
            masks = self._group_update(group, k, masked)
            in_force = o.take(o.constant(group.in_force), k)
            for m, mask in zip(group.masks, masks):
                # in force: the mask; released (leave_enabled: false) or not yet started: ones
                now.setdefault(m.name, []).append(o.pick(in_force, mask, self._one(m.mask)))
            in_force = o.cast(in_force, "float32")
            for cg in group.channel_groups:
                first = group.masks[cg.members[0]]
                keep = 1.0 - in_force * (1.0 - self._channel_keep(masks[cg.members[0]], first.kernel_axes, cg.kind))
                for variable in cg.followers:  # biases, BatchNorm shifts and means: a pruned channel is exactly 0
                    shape = [1] * (len(variable.shape) - 2) + [-1, 1] if len(variable.shape) == 4 else [-1]
                    self._assign(ops, variable, zeroed(o.read(variable), [
                        o.reshape(o.cast(keep, o.dtype_of(variable)), shape)], o))
        factors = {name: _product(parts, self._one(self.pruned[name])) for name, parts in now.items()}
        for name, variable in self.pruned.items():
            self._assign(ops, variable, zeroed(weights[name], [*old[name], factors[name]], o))
        return ops, factors

    def restart_ops(self, k) -> list:
        """At a (re)start at step ``k``: forget a modifier's masks that were not computed at the update point in force
        at ``k`` (weights restored from a backup of another step, or masks computed before a restore), so the next
        :meth:`ops` ranks the weights as they are now instead of zeroing them with another step's masks."""
        o, ops = self.o, []
        for group in self.groups:
            stale = o.not_equal(o.read(group.update_id), o.take(o.constant(group.update_ids), k))
            for m in group.masks:
                self._assign(ops, m.mask, o.where(stale, o.ones_like(o.read(m.mask)), o.read(m.mask)))
            self._assign(ops, group.update_id, o.where(stale, o.constant(-1, o.index_dtype), o.read(group.update_id)))
        return ops

    def gradient_factors(self, k) -> dict[str, list]:
        """Per pruned variable, the masks in force at ``k`` (ones where a mask is not): multiply its gradient
        by them so pruned weights get no update and no optimizer state."""
        o, by_variable = self.o, {}
        for group in self.groups:
            in_force = o.take(o.constant(group.in_force), k)
            for m in group.masks:
                by_variable.setdefault(m.name, []).append(o.where(in_force, o.read(m.mask), self._one(m.mask)))
        return by_variable

    def _one(self, like):
        """A scalar 1 of ``like``'s dtype: ``where`` broadcasts it, no tensor of ones is made."""
        return self.o.one(self.o.dtype_of(like))

    def _rank_at_least(self, scores, count, axis=-1):
        """1 where a score's place in the (stable) order is at least ``count``: the smallest ``count`` go.
        Static shapes: a slice of count elements would make XLA (jit_compile) compile the step anew each step."""
        o = self.o
        rank = o.argsort(o.argsort(scores, axis=axis), axis=axis)
        return o.cast(o.cast(rank, "int32") >= o.cast(count, "int32"), o.dtype_of(scores))

    def _group_update(self, group: _MaskGroup, k, masked: Callable[[str], object]) -> list:
        """The masks in force at ``k``: all recomputed (and stored) when the last update point changed.

        GradualKS ranks ``masked(name)`` (the weights with the masks of step ``k - 1`` applied);
        ConstantKS keeps that tensor's zeros.
        """
        o = self.o
        update_id = o.take(o.constant(group.update_ids), k)
        needed = o.logical_and(o.not_equal(update_id, o.read(group.update_id)), update_id >= 0)

        def recompute():
            weights = {m.name: masked(m.name) for m in group.masks}
            new_masks, assigns = [], []
            joint = self._joint_masks(group, weights, update_id) if group.global_ else {}
            for cg in group.channel_groups:
                joint.update(self._coupled_masks(group, cg, weights, update_id))
            for m in group.masks:
                weight = weights[m.name]
                count = o.take(o.constant(m.counts or [0], o.index_dtype), o.maximum(update_id, 0))
                if group.constant:
                    new = o.cast(o.not_equal(weight, 0), o.dtype_of(weight))
                elif m.name in joint:
                    new = joint[m.name]
                elif m.layout is not None:
                    new = self._structured_mask(weight, m.layout, count, m.kernel_axes)
                else:
                    # each weight's place in the order (ties by flat index, as in recal_torch)
                    new = o.reshape(self._rank_at_least(o.reshape(o.abs(weight), [-1]), count), _shape(weight))
                new_masks.append(new)
                if o.assigns_in_branches:
                    self._assign(assigns, m.mask, new)
            if not o.assigns_in_branches:
                return new_masks
            self._assign(assigns, group.update_id, update_id)
            return o.after(assigns, new_masks)

        def keep():
            return [o.read(m.mask) for m in group.masks]

        masks = o.cond(needed, recompute, keep)
        if not o.assigns_in_branches:  # a JAX branch cannot write a variable: store what the cond chose
            for m, mask in zip(group.masks, masks):
                o.assign(m.mask, mask)
            o.assign(group.update_id, o.where(needed, update_id, o.read(group.update_id)))
        return masks

    def _joint_masks(self, group: _MaskGroup, masked: dict, update_id) -> dict:
        """A global modifier's masks: the smallest magnitudes across all its variables (each flattened in
        canonical [out, in, *spatial] order where known, as recal_torch does, then concatenated in order)."""
        o = self.o
        count = o.take(o.constant(group.masks[0].counts or [0], o.index_dtype), o.maximum(update_id, 0))
        parts = []
        for m in group.masks:
            weight = masked[m.name]
            canonical = o.transpose(weight, m.kernel_axes) if m.kernel_axes else weight
            parts.append(o.reshape(o.abs(canonical), [-1]))
        keep = self._rank_at_least(o.concatenate(parts), count)
        out, start = {}, 0
        for m in group.masks:
            shape = _shape(masked[m.name])
            size = int(np.prod(shape))
            piece = keep[start:start + size]
            start += size
            if m.kernel_axes:
                out[m.name] = o.transpose(o.reshape(piece, [shape[a] for a in m.kernel_axes]), _inverse(m.kernel_axes))
            else:
                out[m.name] = o.reshape(piece, shape)
        return out

    def _per_channel(self, canonical, kind: str):
        """A canonical ``[out, in, *spatial]`` tensor as ``[channels, rest]``: rows (filter) or input channels."""
        if kind == "channel":
            canonical = self.o.transpose(canonical, [1, 0, *range(2, len(canonical.shape))])
        return self.o.reshape(canonical, [_shape(canonical)[0], -1])

    def _channel_keep(self, mask, kernel_axes, kind: str):
        """Per channel, 1 where a member's mask keeps it."""
        return self.o.max(self._per_channel(self.o.transpose(mask, kernel_axes), kind), axis=1)

    def _coupled_masks(self, group: _MaskGroup, cg: _ChannelGroup, masked: dict, update_id) -> dict:
        """The masks of layers sharing channels: the channels of least summed squared norm, zeroed in every
        member (ties by position), as recal_torch's ``group_masks``."""
        o = self.o
        members = [group.masks[i] for i in cg.members]
        count = o.take(o.constant(cg.counts, o.index_dtype), o.maximum(update_id, 0))
        score = _sum_of([o.sum(o.square(self._per_channel(o.transpose(masked[m.name], m.kernel_axes), cg.kind)),
                               axis=1) for m in members])
        keep = self._rank_at_least(score, count)
        out = {}
        for m in members:
            canonical_shape = [_shape(m.variable)[a] for a in m.kernel_axes]
            shape = [-1] + [1] * (len(canonical_shape) - 1) if cg.kind == "filter" else \
                [1, -1] + [1] * (len(canonical_shape) - 2)
            canonical = o.broadcast_to(o.reshape(keep, shape), canonical_shape)
            out[m.name] = o.cast(o.transpose(canonical, _inverse(m.kernel_axes)), o.dtype_of(m.variable))
        return out

    def _structured_mask(self, weight, layout: MaskLayout, count, kernel_axes):
        """recal_torch's ``structured_mask`` in graph ops: the same groups, scores and ties (the core's
        :mod:`recal_core.mask_layout`), on the variable transposed to canonical ``[out, in, *spatial]``."""
        o = self.o
        canonical = o.transpose(weight, kernel_axes)
        canonical_shape = _shape(canonical)
        view = o.abs(o.reshape(o.transpose(canonical, layout.perm), [layout.rows, layout.cols]))
        if layout.n_of_m is not None:
            runs = o.reshape(view, [-1, layout.n_of_m[1]])  # each weight's place in its run's order
            mask_view = o.reshape(self._rank_at_least(runs, count, axis=1), [layout.rows, layout.cols])
        else:
            tile_shape = [layout.rows // layout.group_rows, layout.group_rows,
                          layout.cols // layout.group_cols, layout.group_cols]
            tiles = o.reshape(view, tile_shape)
            scores = (o.sqrt(o.sum(o.square(tiles), axis=[1, 3])) if layout.score == "l2"
                      else o.mean(tiles, axis=[1, 3]))
            keep = o.reshape(self._rank_at_least(o.reshape(scores, [-1]), count), _shape(scores))
            mask_view = o.reshape(o.broadcast_to(keep[:, None, :, None], tile_shape), [layout.rows, layout.cols])
        permuted = o.reshape(mask_view, [canonical_shape[a] for a in layout.perm])
        return o.transpose(o.transpose(permuted, _inverse(layout.perm)), _inverse(kernel_axes))


def _inverse(perm) -> list[int]:
    return [list(perm).index(i) for i in range(len(perm))]


def _product(parts: list, one=None):
    """The product of 0/1 masks; the same tensor twice counts once, and ``one`` (a mask not in force) not at all."""
    unique = []
    for part in parts:
        if part is not one and not any(part is u for u in unique):
            unique.append(part)
    if not unique:
        return one
    result = unique[0]
    for part in unique[1:]:
        result = result * part
    return result


def _sum_of(parts: list):
    result = parts[0]
    for part in parts[1:]:
        result = result + part
    return result


def zeroed(value, masks: list, ops):
    """``value`` with every place a mask holds 0 set to exactly 0 (a ``select``, not a product: a pruned weight is 0
    whatever it held, NaN or infinity included)."""
    o = ops
    one = o.one(o.dtype_of(value)) if masks else None
    keep = _product(masks, one)
    if keep is None or keep is one:  # no mask in force (eager backends see it without computing a tensor)
        return value
    return o.where(keep > 0, value, o.zeros_like(value))
