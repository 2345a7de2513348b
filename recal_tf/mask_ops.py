"""recal's pruning masks as TensorFlow variables and ops, updated at step ``k`` inside the graph.

Shared by the ``tf.compat.v1`` graph API (:mod:`recal_tf.graph`) and Keras (:mod:`recal_tf.keras`):
every per-step value (mask update points, exact zero counts, whether a mask is in force) is tabulated
from the core's :class:`~recal_core.model_plan.ModelPlan` and looked up with ``k``, so a graph, a
``tf.function`` or an XLA-compiled train step applies the same masks without a host call.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import tensorflow as tf

from recal_core.mask_layout import MaskLayout
from recal_core.model_plan import ModelPlan


@dataclass
class _Mask:
    """One variable's mask under one pruning modifier; ``counts[j]``: zeros at the modifier's update j."""

    name: str
    variable: tf.Variable
    mask: tf.Variable
    counts: list[int]
    layout: MaskLayout | None = None  # a structured mask: counts are groups (N:M: weights per run)
    kernel_axes: tuple[int, ...] | None = None  # the variable's axes in canonical [out, in, *spatial] order


@dataclass
class _ChannelGroup:
    """Masks (indices into their modifier's ``masks``) that prune the same channels, ranked together, and
    the per-channel variables zeroed with a pruned filter (:mod:`recal_core.channel_coupling`)."""

    kind: str  # "filter" | "channel"
    members: list[int]
    followers: list[tf.Variable]
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
    update_id: tf.Variable  # the update point the masks were computed at (-1: never)
    update_ids: np.ndarray  # per step: the last update point <= k (-1 before the first)
    in_force: np.ndarray  # per step: whether the masks are enforced
    masks: list[_Mask]
    channel_groups: list[_ChannelGroup] = field(default_factory=list)


class PruningMasks:
    """Every pruning modifier's masks over a model's variables, with the ops that update and apply them.

    ``by_name``: the core's parameter name -> its ``tf.Variable``; ``make_variable(name, shape, dtype,
    initial)``: creates one of recal's own (non-trainable) variables; ``lookup(name)``: a variable by name
    (the per-channel followers of a filter group).
    """

    def __init__(self, plan: ModelPlan, by_name: dict[str, tf.Variable], kernel_axes: dict,
                 make_variable: Callable, lookup: Callable[[str], tf.Variable]):
        self.groups: list[_MaskGroup] = []
        self.pruned: dict[str, tf.Variable] = {}
        total = plan.schedule.total_steps
        for ps in plan.schedule.pruning:
            update_ids, in_force, update_steps = ps.tables(total)
            scope = f"recal/pruning_{ps.index}"
            group = _MaskGroup(ps.constant, bool(getattr(ps.modifier, "global_sparsity", False)),
                               make_variable(f"{scope}/update_id", [], tf.int64, -1), update_ids, in_force, [])
            for name in plan.prune_targets[ps.index]:
                variable = by_name[name]
                mask = make_variable(f"{scope}/masks/{name}", variable.shape, variable.dtype.base_dtype, 1)
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

    def ops(self, k) -> list:
        """Per pruning modifier one conditional update of all its masks, then ``w <- 0 where mask == 0`` per variable."""
        return self.ops_and_factors(k)[0]

    def ops_and_factors(self, k) -> tuple[list, dict[str, tf.Tensor]]:
        """:meth:`ops`, and per pruned variable the product of the masks in force at ``k`` (to mask optimizer
        state with, without reading the masks again).

        New masks rank (and ConstantKS reads) the weights with the masks of step ``k - 1`` applied,
        as the core's :mod:`recal_core.model_plan` says, so a weight pruned earlier (and moved by the
        optimizer since) is never ranked back in. Between updates a step costs one select and two multiplies
        per pruned variable: the ranking input is computed only inside the update branch.
        """
        previous = tf.maximum(k - 1, 0)
        weights: dict[str, tf.Tensor] = {name: variable.read_value() for name, variable in self.pruned.items()}
        old: dict[str, list[tf.Tensor]] = {}
        for group in self.groups:
            was_in_force = tf.gather(tf.constant(group.in_force), previous)
            for m in group.masks:
                # the step just taken ran under the masks of k - 1: they apply to its result even where a
                # modifier ends at k (as recal_torch applies its masks after the optimizer step)
                old.setdefault(m.name, []).append(tf.where(was_in_force, m.mask.read_value(), _one(m.mask)))

        def masked(name: str) -> tf.Tensor:  # called inside an update branch only
            return zeroed(weights[name], old[name])

        ops, now = [], {}
        for group in self.groups:
            masks = _group_update(group, k, masked)
            in_force = tf.gather(tf.constant(group.in_force), k)
            for m, mask in zip(group.masks, masks):
                # in force: the mask; released (leave_enabled: false) or not yet started: ones
                now.setdefault(m.name, []).append(tf.where(in_force, mask, _one(mask)))
            in_force = tf.cast(in_force, tf.float32)
            for cg in group.channel_groups:
                first = group.masks[cg.members[0]]
                keep = 1.0 - in_force * (1.0 - _channel_keep(masks[cg.members[0]], first.kernel_axes, cg.kind))
                for variable in cg.followers:  # biases, BatchNorm shifts and means: a pruned channel is exactly 0
                    shape = [1] * (variable.shape.rank - 2) + [-1, 1] if variable.shape.rank == 4 else [-1]
                    ops.append(variable.assign(zeroed(variable.read_value(), [
                        tf.reshape(tf.cast(keep, variable.dtype.base_dtype), shape)]), read_value=False))
        factors = {name: _product(parts) for name, parts in now.items()}
        for name, variable in self.pruned.items():
            ops.append(variable.assign(zeroed(weights[name], [*old[name], factors[name]]), read_value=False))
        return ops, factors

    def restart_ops(self, k) -> list:
        """At a (re)start at step ``k``: forget a modifier's masks that were not computed at the update point in force
        at ``k`` (weights restored from a backup of another step, or masks computed before a restore), so the next
        :meth:`ops` ranks the weights as they are now instead of zeroing them with another step's masks."""
        ops = []
        for group in self.groups:
            stale = tf.not_equal(group.update_id.read_value(), tf.gather(tf.constant(group.update_ids), k))
            for m in group.masks:
                ops.append(m.mask.assign(tf.where(stale, tf.ones_like(m.mask), m.mask.read_value()), read_value=False))
            ops.append(group.update_id.assign(tf.where(stale, tf.constant(-1, tf.int64), group.update_id.read_value()),
                                              read_value=False))
        return ops

    def gradient_factors(self, k) -> dict[str, list[tf.Tensor]]:
        """Per pruned variable, the masks in force at ``k`` (ones where a mask is not): multiply its gradient
        by them so pruned weights get no update and no optimizer state."""
        by_variable: dict[str, list[tf.Tensor]] = {}
        for group in self.groups:
            in_force = tf.gather(tf.constant(group.in_force), k)
            for m in group.masks:
                by_variable.setdefault(m.name, []).append(tf.where(in_force, m.mask.read_value(), _one(m.mask)))
        return by_variable


def _one(like) -> tf.Tensor:
    """A scalar 1 of ``like``'s dtype: ``tf.where`` broadcasts it, no tensor of ones is made."""
    return tf.ones([], like.dtype)


def _product(parts: list[tf.Tensor]) -> tf.Tensor:
    result = parts[0]
    for part in parts[1:]:
        result = result * part
    return result


def zeroed(value: tf.Tensor, masks: list[tf.Tensor]) -> tf.Tensor:
    """``value`` with every place a mask holds 0 set to exactly 0 (a ``select``, not a product: a pruned weight is 0
    whatever it held, NaN or infinity included)."""
    if not masks:
        return value
    keep = _product(masks)
    return tf.where(keep > 0, value, tf.zeros_like(value))


def _group_update(group: _MaskGroup, k, masked: Callable[[str], tf.Tensor]) -> list[tf.Tensor]:
    """The masks in force at ``k``: all recomputed (and stored) when the last update point changed.

    GradualKS ranks ``masked(name)`` (the weights with the masks of step ``k - 1`` applied);
    ConstantKS keeps that tensor's zeros.
    """
    update_id = tf.gather(tf.constant(group.update_ids), k)
    needed = tf.logical_and(tf.not_equal(update_id, group.update_id.read_value()), update_id >= 0)

    def recompute():
        weights = {m.name: masked(m.name) for m in group.masks}
        new_masks, assigns = [], []
        joint = _joint_masks(group, weights, update_id) if group.global_ else {}
        for cg in group.channel_groups:
            joint.update(_coupled_masks(group, cg, weights, update_id))
        for m in group.masks:
            weight = weights[m.name]
            count = tf.gather(tf.constant(m.counts or [0], tf.int64), tf.maximum(update_id, 0))
            if group.constant:
                new = tf.cast(tf.not_equal(weight, 0), weight.dtype)
            elif m.name in joint:
                new = joint[m.name]
            elif m.layout is not None:
                new = _structured_mask(weight, m.layout, count, m.kernel_axes)
            else:
                flat = tf.reshape(tf.abs(weight), [-1])
                # each weight's place in the order (ties by flat index, as in recal_torch); the smallest
                # count go. Static shapes: a slice of count elements would make XLA (jit_compile) compile
                # the train step anew at every step
                rank = tf.argsort(tf.argsort(flat, stable=True), stable=True)
                new = tf.reshape(tf.cast(rank >= tf.cast(count, rank.dtype), flat.dtype), tf.shape(weight))
            new_masks.append(new)
            assigns.append(m.mask.assign(new, read_value=False))
        assigns.append(group.update_id.assign(update_id, read_value=False))
        with tf.control_dependencies(assigns):
            return [tf.identity(n) for n in new_masks]

    def keep():
        return [m.mask.read_value() for m in group.masks]

    return tf.cond(needed, recompute, keep)


def _joint_masks(group: _MaskGroup, masked: dict[str, tf.Tensor], update_id) -> dict[str, tf.Tensor]:
    """A global modifier's masks: the smallest magnitudes across all its variables (each flattened in
    canonical [out, in, *spatial] order where known, as recal_torch does, then concatenated in order)."""
    count = tf.gather(tf.constant(group.masks[0].counts or [0], tf.int64), tf.maximum(update_id, 0))
    parts = []
    for m in group.masks:
        weight = masked[m.name]
        canonical = tf.transpose(weight, m.kernel_axes) if m.kernel_axes else weight
        parts.append(tf.reshape(tf.abs(canonical), [-1]))
    flat = tf.concat(parts, 0)
    rank = tf.argsort(tf.argsort(flat, stable=True), stable=True)
    keep = tf.cast(rank >= tf.cast(count, rank.dtype), flat.dtype)
    out, start = {}, 0
    for m, part in zip(group.masks, parts):
        weight = masked[m.name]
        size = int(np.prod(weight.shape.as_list()))
        piece = keep[start:start + size]
        start += size
        if m.kernel_axes:
            shape = [weight.shape.as_list()[a] for a in m.kernel_axes]
            inverse = [list(m.kernel_axes).index(i) for i in range(len(m.kernel_axes))]
            out[m.name] = tf.transpose(tf.reshape(piece, shape), inverse)
        else:
            out[m.name] = tf.reshape(piece, tf.shape(weight))
    return out


def _per_channel(canonical: tf.Tensor, kind: str) -> tf.Tensor:
    """A canonical ``[out, in, *spatial]`` tensor as ``[channels, rest]``: rows (filter) or input channels."""
    if kind == "channel":
        rank = canonical.shape.rank
        canonical = tf.transpose(canonical, [1, 0, *range(2, rank)])
    return tf.reshape(canonical, [tf.shape(canonical)[0], -1])


def _channel_keep(mask: tf.Tensor, kernel_axes, kind: str) -> tf.Tensor:
    """Per channel, 1 where a member's mask keeps it."""
    return tf.reduce_max(_per_channel(tf.transpose(mask, kernel_axes), kind), axis=1)


def _coupled_masks(group: _MaskGroup, cg: _ChannelGroup, masked: dict[str, tf.Tensor], update_id) -> dict:
    """The masks of layers sharing channels: the channels of least summed squared norm, zeroed in every
    member (ties by position), as recal_torch's ``group_masks``."""
    members = [group.masks[i] for i in cg.members]
    count = tf.gather(tf.constant(cg.counts, tf.int64), tf.maximum(update_id, 0))
    score = tf.add_n([tf.reduce_sum(tf.square(_per_channel(tf.transpose(masked[m.name], m.kernel_axes), cg.kind)),
                                    axis=1) for m in members])
    rank = tf.argsort(tf.argsort(score, stable=True), stable=True)
    keep = tf.cast(rank >= tf.cast(count, rank.dtype), score.dtype)
    out = {}
    for m in members:
        canonical_shape = [m.variable.shape.as_list()[a] for a in m.kernel_axes]
        shape = [-1] + [1] * (len(canonical_shape) - 1) if cg.kind == "filter" else \
            [1, -1] + [1] * (len(canonical_shape) - 2)
        canonical = tf.broadcast_to(tf.reshape(keep, shape), canonical_shape)
        inverse = [list(m.kernel_axes).index(i) for i in range(len(m.kernel_axes))]
        out[m.name] = tf.cast(tf.transpose(canonical, inverse), m.variable.dtype.base_dtype)
    return out


def _structured_mask(weight: tf.Tensor, layout: MaskLayout, count: tf.Tensor, kernel_axes) -> tf.Tensor:
    """recal_torch's ``structured_mask`` in graph ops: the same groups, scores and ties (the core's
    :mod:`recal_core.mask_layout`), on the variable transposed to canonical ``[out, in, *spatial]``."""
    canonical = tf.transpose(weight, kernel_axes)
    view = tf.abs(tf.reshape(tf.transpose(canonical, layout.perm), [layout.rows, layout.cols]))
    if layout.n_of_m is not None:
        m = layout.n_of_m[1]
        runs = tf.reshape(view, [-1, m])
        order = tf.argsort(runs, axis=1, stable=True)
        rank = tf.argsort(order, axis=1, stable=True)  # each weight's place in its run's order
        mask_view = tf.reshape(tf.cast(rank >= tf.cast(count, rank.dtype), weight.dtype), [layout.rows, layout.cols])
    else:
        tiles = tf.reshape(view, [layout.rows // layout.group_rows, layout.group_rows,
                                  layout.cols // layout.group_cols, layout.group_cols])
        scores = (tf.sqrt(tf.reduce_sum(tf.square(tiles), axis=[1, 3])) if layout.score == "l2"
                  else tf.reduce_mean(tiles, axis=[1, 3]))
        order = tf.argsort(tf.reshape(scores, [-1]), stable=True)
        rank = tf.reshape(tf.argsort(order, stable=True), tf.shape(scores))
        keep = tf.cast(rank >= tf.cast(count, rank.dtype), weight.dtype)[:, None, :, None]
        mask_view = tf.reshape(tf.broadcast_to(keep, tf.shape(tiles)), [layout.rows, layout.cols])
    permuted = tf.reshape(mask_view, [canonical.shape[a] for a in layout.perm])
    inverse = [layout.perm.index(i) for i in range(len(layout.perm))]
    axes_inverse = [list(kernel_axes).index(i) for i in range(len(kernel_axes))]
    return tf.transpose(tf.transpose(permuted, inverse), axes_inverse)
