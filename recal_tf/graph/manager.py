"""Apply a recipe to a ``tf.compat.v1`` training graph: ``create_ops``, ``initialize_session``, ``complete_graph``.

Schedules are not re-derived here: every per-step value (mask update points and exact zero
counts, whether a mask is in force, the LR, the weight decay) is tabulated from the core's
bound schedule and looked up in the graph with the global step ``k``. Run the returned ops once
per training step, after the optimizer: they recompute a mask whenever the schedule's last
update point ``<= k`` changed since the mask was computed, and set ``w <- 0`` where the mask is 0 (a select: exactly
0, NaN or not).
"""

from __future__ import annotations

import logging
import warnings

import numpy as np
import tensorflow as tf

from recal_core import RecipeError
from recal_core.manager import RecipeManager
from recal_core import modifiers as M
from recal_core.model_plan import ModelPlan, plan_model
from recal_core.recipe import Recipe
from recal_core.schedule import RecipeSchedule

from recal_keras.qat_tables import QATTables, quantize_at_completion
from recal_keras.mask_ops import PruningMasks, per_step as _per_step
from recal_keras.errors import RecalWarning
from recal_keras.recipe_support import check_table_size, learned_scales, qat_problems, torch_only_problems
from ..utils import tf_compat
from .channel_graph import graph_spaces
from .params import describe_variables
from .qat import GraphQAT

log = logging.getLogger(__name__)

EXTRAS_KEY_SUMMARIES = "summaries"
EXTRAS_KEY_LEARNING_RATE = "learning_rate"
EXTRAS_KEY_VAR_LIST = "var_list"
EXTRAS_KEY_WEIGHT_DECAY = "weight_decay_loss"  # the penalty to add to the loss
EXTRAS_KEY_WEIGHT_DECAY_RATE = "weight_decay"  # the rate in force (a scalar tensor)
EXTRAS_KEY_UPDATE_OPS = "update_ops"  # QAT's observer updates (also in UPDATE_OPS): run them with the train op
RECAL_VARIABLES = "recal_variables"
RECAL_GRAPH_MARK = "recal_create_ops"


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
        self._masks: PruningMasks | None = None
        self._qat: GraphQAT | None = None
        self._kept: list[tf.Variable] = []  # recal variables that are model state (QAT's ranges)
        self.quantized_ops: list[str] = []  # the Conv2D / MatMul ops QAT quantizes
        self._completed = False

    # --- create_ops ---------------------------------------------------------------------------

    def create_ops(self, steps_per_epoch: int, global_step: tf.Variable | None = None,
                   graph: tf.Graph | None = None, base_lr: float | None = None) -> tuple[list, dict]:
        """Add recal's ops to ``graph`` (the default graph); return ``(mod_ops, mod_extras)``.

        Call it while building the graph, outside any session, once per graph. ``base_lr`` is the
        LR to use before the recipe's first LR modifier starts (needed only if one starts later
        than epoch 0 or has no ``init_lr``).

        Args:
            steps_per_epoch: optimizer steps per epoch of the training loop.
            global_step: the step variable the train op increments (``tf.train.get_or_create_global_step()`` when None).
            graph: the graph to modify (the default graph when None).
            base_lr: the LR in force before the recipe's first LR modifier.
        """
        graph = graph or tf_compat.get_default_graph()
        if tf_compat.get_default_session() is not None:
            raise RuntimeError("create_ops() must be called while building the graph, outside any session; "
                               "open the session after create_ops()")
        if self._graph is not None or graph.get_collection(RECAL_GRAPH_MARK):
            raise RuntimeError("create_ops() was already called for this graph (or by this manager); "
                               "call it once per graph, with one manager")
        schedule = self.recipe.bind(steps_per_epoch)
        check_table_size(schedule, "recal_tf")
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
            extras = {EXTRAS_KEY_SUMMARIES: self._summaries}
            with tf_compat.name_scope("recal"):
                k = self._step_tensor()
                if schedule.quantization:
                    self._qat = self._quantize(schedule, graph, k, by_name)
                    extras[EXTRAS_KEY_UPDATE_OPS] = list(self._qat.updates)
                prune_ops = self._pruning_ops(plan, by_name, k, {p.name: p.kernel_axes for p in infos})
                if lr_table is not None:
                    lr = tf.gather(tf.constant(lr_table, tf.float32), k, name="learning_rate")
                    extras[EXTRAS_KEY_LEARNING_RATE] = lr
                    self._summaries.append(tf_compat.summary.scalar("Modifier_LR/learning_rate", lr))
                if any(True for _ in self.recipe.of_type(M.SetWeightDecayModifier)):
                    decay = plan.groups[0].weight_decay
                    table = _per_step(lambda s: decay(s) or 0.0, schedule.total_steps)
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
        problems = qat_problems(schedule, "in the TensorFlow graph API", learns=True)
        problems += torch_only_problems(schedule, "in the TensorFlow graph API")
        operations = tf_compat.get_default_graph().get_operations() if schedule.quantization else []
        gradients = [op.name for op in operations if op.name.startswith("gradients") or op.type.endswith("Grad")][:3]
        if gradients:
            problems.append(self.recipe.problem(
                schedule.quantization[0][0], None, f"the graph already has gradient ops ({', '.join(gradients)}): "
                "QAT rewires the forward graph, so the optimizer must be built after it",
                expected="call create_ops() after building the model and before optimizer.minimize()"))
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

    def _quantize(self, schedule: RecipeSchedule, graph: tf.Graph, k, by_name) -> GraphQAT:
        """Rewire the forward graph for QAT (:mod:`recal_tf.graph.qat`); its observer updates join UPDATE_OPS."""
        index, _ = schedule.quantization[0]

        def make_variable(name, shape, dtype, initial, trainable=False):
            var = self._variable(f"qat/{name}", shape, dtype, initial, trainable)
            self._kept.append(var)
            return var

        learn = learned_scales(schedule.recipe.modifiers[index])
        qat = GraphQAT(QATTables.from_schedule(schedule, index, k), make_variable, learn)
        qat.plan(graph, set(by_name))
        if not qat.targets:
            raise RecipeError(self.recipe.problem(
                index, None, "the graph has no Conv2D (NHWC) or MatMul whose weight is a trainable variable",
                expected="a model built from tf.nn.conv2d / tf.matmul on variables"))
        where = self.recipe.describe(index)
        if qat.floating:
            warnings.warn(f"{where}: these ops with weights stay float (recal quantizes Conv2D in NHWC and MatMul): "
                          f"{', '.join(qat.floating)}", RecalWarning, stacklevel=4)
        for note in qat.notes:
            warnings.warn(f"{where}: {note}", RecalWarning, stacklevel=4)
        with tf_compat.name_scope("qat"):
            qat.rewrite()
        for update in qat.updates:
            graph.add_to_collection(tf_compat.GraphKeys.UPDATE_OPS, update)
        self.quantized_ops = [t.op.name for t in qat.targets]
        return qat

    def _lr_table(self, plan: ModelPlan, base_lr: float | None) -> np.ndarray | None:
        """The LR per step, or None when the recipe sets none."""
        schedule = plan.schedule
        if not schedule.controls_lr:
            return None
        table = _per_step(plan.groups[0].lr, schedule.total_steps)
        if np.isnan(table).any():
            if base_lr is None:
                first = min(self.recipe.of_type((M.SetLearningRateModifier, M.LearningRateModifier)),
                            key=lambda t: schedule.span(t[1]).start)[0]
                raise RecipeError(self.recipe.problem(
                    first, "start_epoch", "the learning rate before the first LR modifier starts is not set",
                    expected="an LR modifier from epoch 0, or create_ops(..., base_lr=<the LR to start with>)"))
            table[np.isnan(table)] = base_lr
        return table

    def _variable(self, name: str, shape, dtype, initial, trainable: bool = False) -> tf.Variable:
        """A variable of recal's (``trainable``: a learned quantization scale's, which the optimizer built after
        ``create_ops`` trains with the model's; no weight decay, which reads the model's variables)."""
        collections = [tf_compat.GraphKeys.GLOBAL_VARIABLES, RECAL_VARIABLES]
        collections += [tf_compat.GraphKeys.TRAINABLE_VARIABLES] if trainable else []
        var = tf_compat.get_variable(name, shape=shape, dtype=dtype,
                                     initializer=tf_compat.constant_initializer(initial), trainable=trainable,
                                     use_resource=True, collections=collections)
        self._variables.append(var)
        return var

    def _pruning_ops(self, plan: ModelPlan, by_name, k, kernel_axes: dict) -> list:
        """Create the mask variables, then the ops that update and apply them at step ``k``."""
        everything = {v.op.name: v for v in tf_compat.global_variables()}
        self._masks = PruningMasks(plan, by_name, kernel_axes, self._variable, everything.__getitem__)
        for name, variable in self._masks.pruned.items():
            self._summaries.append(tf_compat.summary.scalar(f"Modifier_Pruning/{name}", tf.nn.zero_fraction(variable)))
        return self._mask_ops(k)

    def _mask_ops(self, k) -> list:
        ops = self._masks.ops(k)
        if self._qat is not None:
            ops.append(self._qat.check_observed(k))
        return [tf.group(*ops, name="modifier_ops")] if ops else []

    def mask_gradients(self, grads_and_vars: list[tuple[tf.Tensor, tf.Variable]]
                       ) -> list[tuple[tf.Tensor, tf.Variable]]:
        """Multiply each pruned variable's gradient by its mask in force, so pruned weights get no
        update and no momentum (``opt.apply_gradients(manager.mask_gradients(opt.compute_gradients(loss)))``).

        Args:
            grads_and_vars: what ``optimizer.compute_gradients`` returns."""
        self._require_ops("mask_gradients")
        with self._graph.as_default(), tf_compat.name_scope("recal/mask_gradients"):
            by_variable = self._masks.gradient_factors(self._step_tensor())
            masked = []
            for grad, var in grads_and_vars:
                factors = by_variable.get(var.op.name)
                if grad is not None and factors:
                    for factor in factors:
                        grad = grad * factor
                masked.append((grad, var))
        return masked

    def train_op_with_ops(self, train_op: tf.Operation) -> tf.Operation:
        """One op that runs ``train_op`` and then recal's ops: a single ``sess.run`` per step.

        Equivalent to ``sess.run(train_op); sess.run(mod_ops)``, minus one session call.

        Args:
            train_op: the optimizer's training op (``minimize`` or ``apply_gradients``).
        """
        self._require_ops("train_op_with_ops")
        with self._graph.as_default(), tf_compat.control_dependencies([train_op]), tf_compat.name_scope("recal"):
            ops = self._mask_ops(self._step_tensor())
            updates = self._qat.updates if self._qat is not None else []
            return tf.group(train_op, *ops, *updates, name="train_with_recal")

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

    def initialize_session(self, sess: tf_compat.Session | None = None) -> None:
        """Initialise the variables ``create_ops`` made (only those not yet initialised, so a restored
        checkpoint is kept) and apply the masks in force now, before the first forward pass.

        Args:
            sess: the session to initialise (the default session when None)."""
        self._require_ops("initialize_session")
        sess = self._session(sess)
        self._warn_unused_learning_rate()
        self._require_observer_updates()
        if self._variables:
            initialized = sess.run(self._is_initialized)
            pending = [v.initializer for v, done in zip(self._variables, initialized) if not done]
            if pending:
                sess.run(pending)
        if self._ops:
            sess.run(self._ops)

    def _require_observer_updates(self) -> None:
        """QAT's ranges move only when something runs their update ops: refuse a graph where nothing does."""
        if self._qat is None or self._completed:
            return
        updates = {op.name for op in self._qat.updates}
        for op in self._graph.get_operations():
            if any(c.name in updates for c in op.control_inputs):
                return
        raise RuntimeError(
            "the recipe's QuantizationModifier observes activation ranges with ops that nothing in the graph runs: "
            "build the train op under `with tf_compat.control_dependencies(tf_compat.get_collection("
            "tf_compat.GraphKeys.UPDATE_OPS)):` (as for BatchNorm), or run manager.train_op_with_ops(train_op)")

    def session_run_hook(self) -> tf_compat.train.SessionRunHook:
        """A hook for ``MonitoredTrainingSession``: initialises recal's variables and runs the ops after each step."""
        self._require_ops("session_run_hook")
        return ModifierSessionRunHook(self)

    def complete_graph(self, graph: tf.Graph | None = None, sess: tf_compat.Session | None = None) -> dict[str, float]:
        """Bake every mask into its weight and restore the graph to a plain model.

        After it, recal's variables leave the graph's collections (a new ``Saver()`` and
        ``global_variables_initializer()`` ignore them), the trainable-variables collection is
        restored and recal's summaries are removed. Returns the sparsity of each pruned variable.

        Args:
            graph: the graph ``create_ops`` modified (the default graph when None).
            sess: the session holding its variables (the default session when None).
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
        for name, variable in (self._masks.pruned.items() if self._masks else ()):
            value = sess.run(variable)
            result[name] = float((value == 0).sum()) / value.size
        if self._qat is not None:
            flags = sess.run(self._qat.observed)
            unobserved = [name for name, flag in flags.items() if not flag]
            quantized = quantize_at_completion(self.recipe, self.schedule.quantization[0][0], unobserved, len(flags),
                                               int(sess.run(self._global_step)), RecalWarning, stacklevel=2)
            if graph.finalized:  # MonitoredTrainingSession finalizes it; the rewiring only adds ops
                graph._unsafe_unfinalize()
            with graph.as_default(), tf_compat.name_scope("recal/qat"):
                if quantized:
                    self._qat.complete()
                else:
                    self._qat.remove()
                    self.quantized_ops = []
            updates = graph.get_collection_ref(tf_compat.GraphKeys.UPDATE_OPS)
            updates[:] = [op for op in updates if all(op is not u for u in self._qat.updates)]
        ours = {id(v) for v in self._variables} - {id(v) for v in self._kept}  # QAT's ranges stay model state
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


