"""Apply a recipe to a ``tf.compat.v1`` training graph: ``create_ops``, ``initialize_session``, ``complete_graph``.

Schedules are not re-derived here: every per-step value (mask update points and exact zero
counts, whether a mask is in force, the LR, the weight decay) is tabulated from the core's
bound schedule and looked up in the graph with the global step ``k``. Run the returned ops once
per training step, after the optimizer: they recompute a mask whenever the schedule's last
update point ``<= k`` changed since the mask was computed, and set ``w <- w * mask``.
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass, field

import numpy as np
import tensorflow as tf

from recal_core import RecipeError
from recal_core.manager import RecipeManager
from recal_core import modifiers as M
from recal_core.mask_layout import MaskLayout
from recal_core.model_plan import ModelPlan, is_second_order, plan_model
from recal_core.recipe import Recipe
from recal_core.schedule import RecipeSchedule

from .channel_graph import graph_spaces
from .graph_params import describe_variables
from .utils import tf_compat

log = logging.getLogger(__name__)

EXTRAS_KEY_SUMMARIES = "summaries"
EXTRAS_KEY_LEARNING_RATE = "learning_rate"
EXTRAS_KEY_VAR_LIST = "var_list"
EXTRAS_KEY_WEIGHT_DECAY = "weight_decay_loss"  # the penalty to add to the loss
EXTRAS_KEY_WEIGHT_DECAY_RATE = "weight_decay"  # the rate in force (a scalar tensor)
RECAL_VARIABLES = "recal_variables"
MAX_TABLE_STEPS = 10_000_000  # the graph holds per-step tables (mask update ids, LR, weight decay)
RECAL_GRAPH_MARK = "recal_create_ops"


class RecalWarning(UserWarning):
    """A recipe feature is set up in a way that will not have its effect."""


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


class ScheduledModifierManager(RecipeManager):
    """Holds a recipe and modifies a TensorFlow graph with it (the seed's ``neuralmagicML`` API)."""

    def __init__(self, recipe: Recipe):
        super().__init__(recipe)
        self.schedule: RecipeSchedule | None = None
        self._graph: tf.Graph | None = None
        self._ops: list[tf.Operation] = []
        self._extras: dict = {}
        self._variables: list[tf.Variable] = []
        self._summaries: list[tf.Tensor] = []
        self._is_initialized: list[tf.Tensor] = []
        self._global_step: tf.Variable | None = None
        self._original_trainable: list[tf.Variable] | None = None
        self._groups: list[_MaskGroup] = []
        self._pruned: dict[str, tf.Variable] = {}
        self._completed = False

    # --- create_ops ---------------------------------------------------------------------------

    def create_ops(self, steps_per_epoch: int, global_step: tf.Variable | None = None,
                   graph: tf.Graph | None = None, base_lr: float | None = None) -> tuple[list, dict]:
        """Add recal's ops to ``graph`` (the default graph); return ``(mod_ops, mod_extras)``.

        Call it while building the graph, outside any session, once per graph. ``base_lr`` is the
        LR to use before the recipe's first LR modifier starts (needed only if one starts later
        than epoch 0 or has no ``init_lr``).
        """
        graph = graph or tf_compat.get_default_graph()
        if tf_compat.get_default_session() is not None:
            raise RuntimeError("create_ops() must be called while building the graph, outside any session; "
                               "open the session after create_ops()")
        if self._graph is not None or graph.get_collection(RECAL_GRAPH_MARK):
            raise RuntimeError("create_ops() was already called for this graph (or by this manager); "
                               "call it once per graph, with one manager")
        schedule = self.recipe.bind(steps_per_epoch)
        if schedule.total_steps > MAX_TABLE_STEPS:
            raise ValueError(f"the recipe runs {schedule.total_steps:,} steps ({self.recipe.max_epochs} epochs x "
                             f"{steps_per_epoch:,}); recal_tf tabulates per-step values in the graph and takes at "
                             f"most {MAX_TABLE_STEPS:,} steps")
        with graph.as_default():
            variables = list(tf_compat.trainable_variables())
            infos, by_name = describe_variables(graph, variables)
            sizes = {name: int(np.prod(v.shape.as_list())) for name, v in by_name.items()}
            plan = self._plan(schedule, infos, sizes, base_lr)
            lr_table = self._lr_table(plan, base_lr)
            self.schedule = schedule
            self._graph = graph
            graph.add_to_collection(RECAL_GRAPH_MARK, tf.constant(True, name="recal/marker"))
            self._global_step = global_step if global_step is not None else tf_compat.train.get_or_create_global_step()
            with tf_compat.name_scope("recal"):
                k = self._step_tensor()
                prune_ops = self._pruning_ops(plan, by_name, k, {p.name: p.kernel_axes for p in infos})
                extras = {EXTRAS_KEY_SUMMARIES: self._summaries}
                if lr_table is not None:
                    lr = tf.gather(tf.constant(lr_table, tf.float32), k, name="learning_rate")
                    extras[EXTRAS_KEY_LEARNING_RATE] = lr
                    self._summaries.append(tf_compat.summary.scalar("Modifier_LR/learning_rate", lr))
                if any(True for _ in self.recipe.of_type(M.SetWeightDecayModifier)):
                    decay = plan.groups[0].weight_decay
                    table = [decay(s) or 0.0 for s in range(schedule.total_steps + 1)]
                    rate = tf.gather(tf.constant(table, tf.float32), k, name="weight_decay")
                    penalty = rate * tf.add_n([tf.nn.l2_loss(tf.cast(v, tf.float32)) for v in variables])
                    extras[EXTRAS_KEY_WEIGHT_DECAY_RATE] = rate
                    extras[EXTRAS_KEY_WEIGHT_DECAY] = tf.identity(penalty, name="weight_decay_loss")
                    self._summaries.append(tf_compat.summary.scalar("Modifier_WeightDecay/weight_decay", rate))
            extras[EXTRAS_KEY_VAR_LIST] = self._apply_trainable(graph, plan, by_name)
            # built now: MonitoredTrainingSession finalizes the graph before initialize_session runs
            self._is_initialized = [tf.raw_ops.VarIsInitializedOp(resource=v.handle) for v in self._variables]
        self._ops = prune_ops
        self._extras = extras
        return list(prune_ops), dict(extras)

    def _plan(self, schedule: RecipeSchedule, infos, sizes, base_lr: float | None) -> ModelPlan:
        """The core's plan for this graph's variables; plus TensorFlow's own limits, every problem at once."""
        problems = []
        for index, _ in schedule.quantization:
            problems.append(self.recipe.problem(
                index, None, "quantization-aware training is not yet available in TensorFlow",
                expected="run this recipe's QuantizationModifier with recal_torch, or remove it for TensorFlow"))
        for ps in schedule.pruning:
            if is_second_order(ps):
                tag = ps.modifier.tag
                problems.append(self.recipe.problem(
                    ps.index, None, f"second-order pruning ({tag}) is not available in the TensorFlow graph API",
                    expected=f"run this recipe's {tag} with recal_torch, or use GradualKSModifier"))
        for index, _, _ in schedule.distillation:
            problems.append(self.recipe.problem(
                index, None, "knowledge distillation is not available in the TensorFlow graph API",
                expected="run this recipe's DistillationModifier with recal_torch, or remove it for TensorFlow"))
        for index, m, span in schedule.trainable:
            if span.start != 0 or span.end is not None:
                field = "start_epoch" if span.start != 0 else "end_epoch"
                problems.append(self.recipe.problem(
                    index, field, "TensorFlow fixes the trainable variables when the optimizer is built",
                    value=getattr(m, field), expected="start_epoch -1 (or 0) and end_epoch -1 in TensorFlow"))
        try:
            plan = plan_model(schedule, infos, sizes, groups=[(base_lr, None)],
                              channel_spaces=lambda: graph_spaces(tf_compat.get_default_graph()))
        except RecipeError as err:
            problems += err.problems
        if problems:
            raise RecipeError(problems)
        return plan

    def _lr_table(self, plan: ModelPlan, base_lr: float | None) -> list[float] | None:
        """The LR per step, or None when the recipe sets none."""
        schedule = plan.schedule
        if not schedule.controls_lr:
            return None
        table = [plan.groups[0].lr(k) for k in range(schedule.total_steps + 1)]
        if any(v is None for v in table):
            if base_lr is None:
                first = min(self.recipe.of_type((M.SetLearningRateModifier, M.LearningRateModifier)),
                            key=lambda t: schedule.span(t[1]).start)[0]
                raise RecipeError(self.recipe.problem(
                    first, "start_epoch", "the learning rate before the first LR modifier starts is not set",
                    expected="an LR modifier from epoch 0, or create_ops(..., base_lr=<the LR to start with>)"))
            table = [base_lr if v is None else v for v in table]
        return table

    def _variable(self, name: str, shape, dtype, initializer) -> tf.Variable:
        var = tf_compat.get_variable(name, shape=shape, dtype=dtype, initializer=initializer, trainable=False,
                                     use_resource=True,
                                     collections=[tf_compat.GraphKeys.GLOBAL_VARIABLES, RECAL_VARIABLES])
        self._variables.append(var)
        return var

    def _pruning_ops(self, plan: ModelPlan, by_name, k, kernel_axes: dict) -> list:
        """Create the mask variables, then the ops that update and apply them at step ``k``."""
        total = plan.schedule.total_steps
        for ps in plan.schedule.pruning:
            update_ids, in_force, update_steps = ps.tables(total)
            with tf_compat.variable_scope(f"recal/pruning_{ps.index}", reuse=False):
                is_global = bool(getattr(ps.modifier, "global_sparsity", False))
                group = _MaskGroup(ps.constant, is_global, self._variable("update_id", [], tf.int64,
                                                                           tf_compat.constant_initializer(-1)),
                                   update_ids, in_force, [])
                for name in plan.prune_targets[ps.index]:
                    variable = by_name[name]
                    mask = self._variable(f"masks/{name}", variable.shape, variable.dtype.base_dtype,
                                          tf_compat.ones_initializer())
                    counts = [plan.global_zeros(ps.index, u) if is_global else plan.masks[name].count(ps, u) or 0
                              for u in update_steps]
                    group.masks.append(_Mask(name, variable, mask, counts, plan.masks[name].layouts.get(ps.index),
                                             kernel_axes.get(name)))
            names = [m.name for m in group.masks]
            everything = {v.op.name: v for v in tf_compat.global_variables()}
            group.channel_groups = [
                _ChannelGroup(g.kind, [names.index(n) for n in g.members], [everything[f] for f in g.followers],
                              [plan.channel_count(g, u) for u in update_steps] or [0])
                for g in plan.channel_groups if g.modifier == ps.index]
            self._groups.append(group)
        for name in plan.masks:
            variable = by_name[name]
            self._pruned[name] = variable
            self._summaries.append(tf_compat.summary.scalar(f"Modifier_Pruning/{name}", tf.nn.zero_fraction(variable)))
        return self._mask_ops(k)

    def _mask_ops(self, k) -> list:
        """Per pruning modifier one conditional update of all its masks, then ``w <- w * mask`` per variable.

        New masks rank (and ConstantKS reads) the weights with the masks of step ``k - 1`` applied,
        as the core's :mod:`recal_core.model_plan` says, so a weight pruned earlier (and moved by the
        optimizer since) is never ranked back in.
        """
        previous = tf.maximum(k - 1, 0)
        masked: dict[str, tf.Tensor] = {name: variable.read_value() for name, variable in self._pruned.items()}
        for group in self._groups:
            was_in_force = tf.gather(tf.constant(group.in_force), previous)
            for m in group.masks:
                masked[m.name] = masked[m.name] * tf.where(was_in_force, m.mask.read_value(), tf.ones_like(m.mask))
        factors: dict[str, list[tf.Tensor]] = {}
        ops = []
        for group in self._groups:
            masks = _group_update(group, k, masked)
            in_force = tf.cast(tf.gather(tf.constant(group.in_force), k), tf.float32)
            for m, mask in zip(group.masks, masks):
                # in force: the mask; released (leave_enabled: false) or not yet started: ones
                factors.setdefault(m.name, []).append(1.0 - tf.cast(in_force, mask.dtype) * (1.0 - mask))
            for cg in group.channel_groups:
                first = group.masks[cg.members[0]]
                keep = 1.0 - in_force * (1.0 - _channel_keep(masks[cg.members[0]], first.kernel_axes, cg.kind))
                for variable in cg.followers:  # biases, BatchNorm shifts and means: a pruned channel is exactly 0
                    shape = [1] * (variable.shape.rank - 2) + [-1, 1] if variable.shape.rank == 4 else [-1]
                    ops.append(variable.assign(variable * tf.reshape(tf.cast(keep, variable.dtype.base_dtype), shape),
                                               read_value=False))
        for name, parts in factors.items():
            variable = self._pruned[name]
            effective = parts[0]
            for part in parts[1:]:
                effective = effective * part
            ops.append(variable.assign(variable * effective, read_value=False))
        return [tf.group(*ops, name="modifier_ops")] if ops else []

    def mask_gradients(self, grads_and_vars: list[tuple[tf.Tensor, tf.Variable]]) -> list[tuple[tf.Tensor, tf.Variable]]:
        """Multiply each pruned variable's gradient by its mask in force, so pruned weights get no
        update and no momentum (``opt.apply_gradients(manager.mask_gradients(opt.compute_gradients(loss)))``)."""
        self._require_ops("mask_gradients")
        by_variable: dict[str, list[tf.Tensor]] = {}
        with self._graph.as_default(), tf_compat.name_scope("recal/mask_gradients"):
            step = self._step_tensor()
            for group in self._groups:
                in_force = tf.gather(tf.constant(group.in_force), step)
                for m in group.masks:
                    factor = tf.where(in_force, m.mask.read_value(), tf.ones_like(m.mask))
                    by_variable.setdefault(m.name, []).append(factor)
            masked = []
            for grad, var in grads_and_vars:
                factors = by_variable.get(var.op.name)
                if grad is not None and factors:
                    for factor in factors:
                        grad = grad * factor
                masked.append((grad, var))
        return masked

    def train_op_with_ops(self, train_op) -> tf.Operation:
        """One op that runs ``train_op`` and then recal's ops: a single ``sess.run`` per step.

        Equivalent to ``sess.run(train_op); sess.run(mod_ops)``, minus one session call.
        """
        self._require_ops("train_op_with_ops")
        with self._graph.as_default(), tf_compat.control_dependencies([train_op]), tf_compat.name_scope("recal"):
            ops = self._mask_ops(self._step_tensor())
            return tf.group(train_op, *ops, name="train_with_recal")

    def _step_tensor(self) -> tf.Tensor:
        """The step ``k`` the tables are read at: the global step (read where this is built, so under
        a control dependency it is read after the optimizer's increment), clipped to the last step."""
        value = self._global_step.read_value() if hasattr(self._global_step, "read_value") else self._global_step
        return tf.minimum(tf.cast(value, tf.int64), self.schedule.total_steps, name="step")

    def _apply_trainable(self, graph: tf.Graph, plan: ModelPlan, by_name) -> list[tf.Variable]:
        """The trainable-variables collection as the plan says at step 0 (it spans the whole run here)."""
        collection = graph.get_collection_ref(tf_compat.GraphKeys.TRAINABLE_VARIABLES)
        self._original_trainable = list(collection)
        flags = plan.trainable(0, {name: True for name in plan.trainable_names})
        if not flags:
            return list(collection)
        frozen = {id(by_name[name]) for name, flag in flags.items() if not flag}
        keep = [v for v in collection if id(v) not in frozen]
        collection[:] = keep
        return list(keep)

    # --- sessions -------------------------------------------------------------------------------

    def _session(self, sess):
        sess = sess or tf_compat.get_default_session()
        if sess is None:
            raise RuntimeError("no session: pass one, or call this inside `with tf_compat.Session() as sess:`")
        return sess

    def _require_ops(self, what: str) -> None:
        if self._graph is None:
            raise RuntimeError(f"call manager.create_ops(...) before {what}()")

    def initialize_session(self, sess=None) -> None:
        """Initialise the variables ``create_ops`` made (only those not yet initialised, so a restored
        checkpoint is kept) and apply the masks in force now, before the first forward pass."""
        self._require_ops("initialize_session")
        sess = self._session(sess)
        self._warn_unused_learning_rate()
        if self._variables:
            initialized = sess.run(self._is_initialized)
            pending = [v.initializer for v, done in zip(self._variables, initialized) if not done]
            if pending:
                sess.run(pending)
        if self._ops:
            sess.run(self._ops)

    def session_run_hook(self) -> tf_compat.train.SessionRunHook:
        """A hook for ``MonitoredTrainingSession``: initialises recal's variables and runs the ops after each step."""
        self._require_ops("session_run_hook")
        return ModifierSessionRunHook(self)

    def complete_graph(self, graph: tf.Graph | None = None, sess=None) -> dict[str, float]:
        """Bake every mask into its weight and restore the graph to a plain model.

        After it, recal's variables leave the graph's collections (a new ``Saver()`` and
        ``global_variables_initializer()`` ignore them), the trainable-variables collection is
        restored and recal's summaries are removed. Returns the sparsity of each pruned variable.
        """
        self._require_ops("complete_graph")
        graph = graph or tf_compat.get_default_graph()
        if graph is not self._graph:
            raise ValueError("complete_graph() got a different graph from the one create_ops() modified")
        sess = self._session(sess)
        self._warn_unused_learning_rate()
        if self._ops:
            sess.run(self._ops)
        result = {}
        for name, variable in self._pruned.items():
            value = sess.run(variable)
            result[name] = float((value == 0).sum()) / value.size
        ours = {id(v) for v in self._variables}
        for key in (tf_compat.GraphKeys.GLOBAL_VARIABLES, RECAL_VARIABLES):
            collection = graph.get_collection_ref(key)
            collection[:] = [v for v in collection if id(v) not in ours]
        summaries = graph.get_collection_ref(tf_compat.GraphKeys.SUMMARIES)
        summaries[:] = [s for s in summaries if all(s is not ours_s for ours_s in self._summaries)]
        if self._original_trainable is not None:
            graph.get_collection_ref(tf_compat.GraphKeys.TRAINABLE_VARIABLES)[:] = self._original_trainable
        self._completed = True
        return result

    def _warn_unused_learning_rate(self) -> None:
        lr = self._extras.get(EXTRAS_KEY_LEARNING_RATE)
        if lr is None:
            return
        summary_ops = {s.op for s in self._summaries}
        if not [op for op in lr.consumers() if op not in summary_ops]:
            warnings.warn("the recipe has LR modifiers, but nothing uses mod_extras[EXTRAS_KEY_LEARNING_RATE]: "
                          "pass it to your optimizer (learning_rate=mod_extras[EXTRAS_KEY_LEARNING_RATE])",
                          RecalWarning, stacklevel=3)


class ModifierSessionRunHook(tf_compat.train.SessionRunHook):
    """Runs a manager's ops after every training step (for ``MonitoredTrainingSession`` / Estimators)."""

    def __init__(self, manager: ScheduledModifierManager):
        self.manager = manager

    def after_create_session(self, session, coord) -> None:
        self.manager.initialize_session(session)

    def after_run(self, run_context, run_values) -> None:
        if self.manager._ops:
            run_context.session.run(self.manager._ops)


def _group_update(group: _MaskGroup, k, masked: dict[str, tf.Tensor]) -> list[tf.Tensor]:
    """The masks in force at ``k``: all recomputed (and stored) when the last update point changed.

    GradualKS ranks ``masked[name]`` (the weights with the masks of step ``k - 1`` applied);
    ConstantKS keeps that tensor's zeros.
    """
    update_id = tf.gather(tf.constant(group.update_ids), k)
    needed = tf.logical_and(tf.not_equal(update_id, group.update_id.read_value()), update_id >= 0)

    def recompute():
        new_masks, assigns = [], []
        joint = _joint_masks(group, masked, update_id) if group.global_ else {}
        for cg in group.channel_groups:
            joint.update(_coupled_masks(group, cg, masked, update_id))
        for m in group.masks:
            weight = masked[m.name]
            count = tf.gather(tf.constant(m.counts or [0], tf.int64), tf.maximum(update_id, 0))
            if group.constant:
                new = tf.cast(tf.not_equal(weight, 0), weight.dtype)
            elif m.name in joint:
                new = joint[m.name]
            elif m.layout is not None:
                new = _structured_mask(weight, m.layout, count, m.kernel_axes)
            else:
                flat = tf.reshape(tf.abs(weight), [-1])
                order = tf.argsort(flat, stable=True)  # ties broken by flat index, as in recal_torch
                pruned = tf.expand_dims(order[:count], 1)
                new = tf.reshape(tf.tensor_scatter_nd_update(tf.ones_like(flat), pruned,
                                                             tf.zeros(tf.shape(pruned)[:1], flat.dtype)),
                                 tf.shape(weight))
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
