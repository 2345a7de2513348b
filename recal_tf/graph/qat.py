"""Quantization-aware training in a ``tf.compat.v1`` graph, rewired in place (as ``tf.contrib.quantize`` did).

``create_ops`` calls :meth:`GraphQAT.rewrite` after the model is built and before the optimizer, so the
gradients are taken through the fake quantization. Each ``Conv2D`` / ``MatMul`` whose weight is a variable:

- reads its weight through int8 per-channel fake quantization; a conv followed by ``FusedBatchNorm`` (an
  inference-mode one beside a training-mode one, joined by ``tf.where``, or the inference one alone) gets the
  BatchNorm-folded weight, as torch.ao's ConvBn: ``q(w * s) / s`` with ``s = gamma / sqrt(moving_var + eps)``,
  so the BatchNorm after it still normalises with batch statistics while training; from ``freeze_bn_stats_epoch``
  the training path uses the moving statistics and stops updating them;
- has its output (after its bias, BatchNorm and ReLU: the ReLU folds into the range) fake-quantized to uint8,
  and its input too unless that is another quantized output through max-pooling, reshapes or identities.

Activation ranges are moving averages, updated by ops in ``UPDATE_OPS`` (run them with the train op, as for
BatchNorm) after the forward pass of the step has used the range so far; a tensor passes unquantized until its
first observation. :meth:`GraphQAT.complete` rewires the graph for inference and export: no switches, the BatchNorm
folded into the conv (``conv(x, q(w * s)) + beta + (b - mean) * s``), each bias rounded to whole steps of input
scale x weight scale (the int32 the int8 layer holds), so a frozen graph exports to QDQ ONNX that converts exactly.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import tensorflow as tf

from recal_keras.fake_quant import (bias_on_int32_grid, fake_quant_activation, fake_quant_weight, moving_range,
                                    weight_scale)
from recal_keras.qat_tables import QATTables
from recal_keras.lsq import LOG_RATIO, TINY, input_step, kernel_step, per_channel, per_tensor
from recal_keras.tensor_ops import TensorFlowOps
from .params import KERNEL_INPUTS, _variable_op
from ..utils import tf_compat

QUANTIZED_OPS = ("Conv2D", "MatMul")  # of the ops with a kernel (params.KERNEL_INPUTS); the rest stay float
BN_OPS = ("FusedBatchNorm", "FusedBatchNormV2", "FusedBatchNormV3")
PASS_THROUGH = ("MaxPool", "Reshape", "Identity", "Squeeze", "ExpandDims")


@dataclass
class _Target:
    """One conv / matmul to quantize and what follows it."""

    op: tf.Operation
    axis: int  # the weight's output-channel axis
    bias: tf.Operation | None = None  # BiasAdd / Add of a variable after it
    bn_infer: tf.Operation | None = None  # the inference-mode FusedBatchNorm after it (folded)
    bn_train: tf.Operation | None = None  # the training-mode one beside it
    pre_activation: tf.Tensor | None = None  # the output before the ReLU (the BatchNorm's, when folded)
    output: tf.Tensor | None = None  # the output to quantize (after the ReLU when there is one)
    folded_weight: tf.Tensor | None = None  # q(w * s) (BatchNorm) or q(w)
    scale: tf.Tensor | None = None  # s, with a folded BatchNorm
    float_weight: tf.Tensor | None = None  # what the op read before the rewrite
    learned_scale: tf.Tensor | None = None  # the weight's learned per-channel scales as last trained (observer: lsq)


@dataclass
class GraphQAT:
    """The QAT rewrite of one graph, with its switches (to remove for export) and observer updates."""

    tables: QATTables
    make_variable: Callable  # (name, shape, dtype, initial, trainable=False) -> a recal variable
    learn: tuple[bool, bool] = (False, False)  # the weights' and the layers' inputs' scales learned (observer: lsq)
    targets: list[_Target] = field(default_factory=list)
    floating: list[str] = field(default_factory=list)  # ops with a variable weight left float
    notes: list[str] = field(default_factory=list)  # what was not folded, and why
    updates: list[tf.Operation] = field(default_factory=list)
    _switches: list[tuple[tf.Tensor, tf.Tensor, tf.Tensor]] = field(default_factory=list)  # (where(on, fq, x), fq, x)
    _quantized: dict = field(default_factory=dict)  # tensor name -> its fake-quantized tensor
    _ranges: dict = field(default_factory=dict)  # switch output name -> the (min, max) its fake quant reads
    observed: dict = field(default_factory=dict)  # each observed tensor's name -> its "observed" flag variable

    # --- planning -------------------------------------------------------------------------------

    def plan(self, graph: tf.Graph, trainable: set[str]) -> None:
        """The ops whose kernel is a trainable variable: quantized (``targets``) or named as float."""
        for op in graph.get_operations():
            index = KERNEL_INPUTS.get(op.type)
            var = _variable_op(op.inputs[index]) if index is not None and len(op.inputs) > index else None
            if var is None or var.name not in trainable:
                continue
            if op.type not in QUANTIZED_OPS or (op.type == "Conv2D" and op.get_attr("data_format") != b"NHWC"):
                self.floating.append(f"{op.name} ({op.type})")
                continue
            axis = 3 if op.type == "Conv2D" else (0 if op.get_attr("transpose_b") else 1)
            self.targets.append(self._follow(_Target(op, axis)))

    def _follow(self, t: _Target) -> _Target:
        """The bias, BatchNorm and ReLU after ``t.op`` (each only when it is the single consumer)."""
        cur = t.op.outputs[0]
        users = cur.consumers()
        if len(users) == 1 and users[0].type in ("BiasAdd", "Add", "AddV2") and \
                any(_variable_op(i) is not None for i in users[0].inputs if i is not cur):
            t.bias, cur = users[0], users[0].outputs[0]
        users = cur.consumers()
        bns = [u for u in users if u.type in BN_OPS and u.inputs[0] is cur]
        if bns and t.op.type == "Conv2D" and len(bns) == len(users):
            infer = [b for b in bns if not b.get_attr("is_training")]
            train = [b for b in bns if b.get_attr("is_training")]
            joined = _single_consumer(*(b.outputs[0] for b in bns))
            if len(infer) == 1 and len(train) <= 1 and all(b.get_attr("data_format") == b"NHWC" for b in bns) and \
                    (len(bns) == 1 or (joined is not None and joined.type in ("Select", "SelectV2"))):
                t.bn_infer, t.bn_train = infer[0], (train[0] if train else None)
                cur = t.bn_infer.outputs[0] if len(bns) == 1 else joined.outputs[0]
            else:
                self.notes.append(f"the BatchNorm after {t.op.name} is not folded into its weights (recal folds an "
                                  "inference-mode FusedBatchNorm, alone or beside a training-mode one joined by "
                                  "tf.where): it stays float")
        t.pre_activation = cur
        users = cur.consumers()
        if len(users) == 1 and users[0].type == "Relu":
            cur = users[0].outputs[0]
        t.output = cur
        return t

    # --- the training rewrite ------------------------------------------------------------------

    def rewrite(self) -> None:
        """Wire the fake quantization into the graph (in the current name scope)."""
        enabled = self.tables.at(self.tables.enabled)
        for t in self.targets:
            with tf_compat.name_scope(_scope(t.op)):
                self._quantize_weight(t, enabled)
                self._freeze_bn(t)
        for t in self.targets:
            users = list(t.output.consumers())
            with tf_compat.name_scope(_scope(t.op)):
                fq = self._observe(t.output, f"{_scope(t.op)}_output", enabled)
            _reroute(t.output, fq, only=users)
        for t in self.targets:
            x = t.op.inputs[0]
            if self._source(x) is None:
                with tf_compat.name_scope(_scope(t.op)):
                    fq = self._quantized.get(x.name) or self._observe(x, f"{_scope(t.op)}_input", enabled,
                                                                      self.learn[1])
                t.op._update_input(0, fq)

    def _quantize_weight(self, t: _Target, enabled) -> None:
        w = t.float_weight = t.op.inputs[1]
        if t.bn_infer is not None:
            gamma, variance = t.bn_infer.inputs[1], t.bn_infer.inputs[4]
            t.scale = gamma / tf.sqrt(tf.stop_gradient(variance) + t.bn_infer.get_attr("epsilon"))
        folded = w * t.scale if t.scale is not None else w
        levels = self.tables.weight_levels
        if self.learn[0]:
            trained = self._learned_weight(t, folded, levels)
            t.folded_weight = fake_quant_weight(folded, t.axis, levels, scale=t.learned_scale)
        else:
            t.folded_weight = trained = fake_quant_weight(folded, t.axis, levels)
        quantized = trained / t.scale if t.scale is not None else trained
        t.op._update_input(1, tf.where(enabled, quantized, w, name="weight"))

    def _learned_weight(self, t: _Target, w: tf.Tensor, levels: int) -> tf.Tensor:
        """``w`` on its per-channel grid with learned scales (:mod:`recal_keras.lsq`): their variables, assigned by an
        update op after the forward pass; the recorded scale is what the export quantizes with."""
        name, channels = f"{_scope(t.op)}_weight_scales", w.shape[t.axis]
        held = {n: self.make_variable(f"{name}/{n}", [channels], tf.float32, 0.0) for n in ("start", "current")}
        held["started"] = self.make_variable(f"{name}/started", [], tf.float32, 0.0)
        log_ratio = self.make_variable(f"{name}/{LOG_RATIO}", [channels], tf.float32, 0.0, trainable=True)
        ops = TensorFlowOps()
        scale, new = kernel_step(ops, self.tables.at(self.tables.observing),
                                 weight_scale(tf.stop_gradient(w), t.axis, levels), held["start"].read_value(),
                                 held["started"].read_value(), held["current"].read_value(), log_ratio.read_value())
        t.learned_scale = tf.maximum(held["current"].read_value(), TINY)
        out = per_channel(ops, w, scale, t.axis, levels)
        self._update_after(out, held, new, "learned_scales")
        return out

    def _update_after(self, out: tf.Tensor, variables: dict, values: dict, name: str) -> None:
        """Assign ``values`` to ``variables`` (by name) once the forward pass computed ``out`` (an ``UPDATE_OPS``
        op)."""
        with tf_compat.control_dependencies([out]):
            self.updates.append(tf.group(*(v.assign(values[n], read_value=False) for n, v in variables.items()),
                                         name=name))

    def _freeze_bn(self, t: _Target) -> None:
        """From ``freeze_bn_stats_epoch``: the training path normalises with the moving statistics, and the
        moving-average updates (which read the training BatchNorm's batch statistics) leave them as they are."""
        if t.bn_train is None:
            return
        frozen = self.tables.at(self.tables.bn_frozen)
        train, infer = t.bn_train, t.bn_infer
        for index, moving in ((0, infer.outputs[0]), (1, infer.inputs[3]), (2, infer.inputs[4])):
            out = train.outputs[index]
            if out.consumers():
                switched = tf.where(frozen, moving, out, name=f"bn_frozen_{index}")
                _reroute(out, switched, keep={switched.op})

    def _observe(self, x: tf.Tensor, name: str, enabled, learned: bool = False) -> tf.Tensor:
        """``x`` fake-quantized with a moving-average range (``learned``: a learned scale, its range recorded in
        the same variables); registers the range's update op."""
        low = self.make_variable(f"{name}/min", [], tf.float32, 0.0)
        high = self.make_variable(f"{name}/max", [], tf.float32, 0.0)
        seen = self.make_variable(f"{name}/observed", [], tf.float32, 0.0)
        self.observed[x.name] = seen
        low_now, high_now, seen_now = low.read_value(), high.read_value(), seen.read_value()
        fq = fake_quant_activation(x, low_now, high_now)
        out = tf.where(tf.logical_and(enabled, seen_now > 0), fq, x, name="quantized")
        observe = tf.logical_and(enabled, tf.logical_not(self.tables.at(self.tables.observers_frozen)))
        if learned:
            out, new_low, new_high = self._learned_input(x, name, observe, out, seen_now)
        with tf_compat.control_dependencies([out]):  # after the forward pass used the range so far
            if not learned:
                new_low, new_high = moving_range(tf.reduce_min(x), tf.reduce_max(x), low_now, high_now, seen_now > 0)
            update = tf.group(low.assign(tf.where(observe, new_low, low_now), read_value=False),
                              high.assign(tf.where(observe, new_high, high_now), read_value=False),
                              seen.assign(tf.where(observe, 1.0, seen_now), read_value=False),
                              name="observe")
        self.updates.append(update)
        self._switches.append((out, fq, x))
        self._quantized[x.name] = out
        self._ranges[out.name] = (low_now, high_now)
        return out

    def _learned_input(self, x: tf.Tensor, name: str, observe, out: tf.Tensor, seen):
        """A layer input's learned scale (:mod:`recal_keras.lsq`, started from the first QAT step's batch range):
        ``(x`` on its grid while the observers run, else ``out``; the range it records)."""
        held = {"start": self.make_variable(f"{name}/start_scale", [], tf.float32, 0.0),
                "zero_point": self.make_variable(f"{name}/zero_point", [], tf.float32, 0.0)}
        log_ratio = self.make_variable(f"{name}/{LOG_RATIO}", [], tf.float32, 0.0, trainable=True)
        ops = TensorFlowOps()
        scale, zero, new = input_step(ops, tf.logical_and(observe, seen <= 0), tf.reduce_min(tf.stop_gradient(x)),
                                      tf.reduce_max(tf.stop_gradient(x)), held["start"].read_value(),
                                      held["zero_point"].read_value(), log_ratio.read_value())
        out = tf.where(observe, per_tensor(ops, x, scale, zero), out, name="learned")
        self._update_after(out, held, new, "learned_scale")
        return out, new["min"], new["max"]

    def _source(self, x: tf.Tensor) -> tf.Tensor | None:
        """The fake-quantized output ``x`` comes from through pass-through ops, if any."""
        outputs = {out.name for out, _, _ in self._switches}
        while x.name not in outputs and x.op.type in PASS_THROUGH and x.op.inputs:
            x = x.op.inputs[0]
        return x if x.name in outputs else None

    def check_observed(self, k) -> tf.Operation:
        """An op for ``mod_ops`` (run after the train op, at the new step ``k``): fails when the step just taken
        should have observed every range and one was never observed (nothing ran the update ops)."""
        t, previous = self.tables, tf.maximum(k - 1, 0)
        should = tf.logical_and(t.at(t.enabled, previous), tf.logical_not(t.at(t.observers_frozen, previous)))
        should = tf.logical_and(should, k > 0)
        observed = tf.reduce_min(tf.stack([v.read_value() for v in self.observed.values()]))
        return tf.debugging.Assert(tf.logical_or(tf.logical_not(should), observed > 0), [
            "recal QAT: an activation range was never observed: run tf_compat.GraphKeys.UPDATE_OPS with the train "
            "op (`with tf_compat.control_dependencies(tf_compat.get_collection(tf_compat.GraphKeys.UPDATE_OPS)):`) "
            "or use manager.train_op_with_ops(train_op)"], name="check_observed")

    # --- inference ----------------------------------------------------------------------------

    def remove(self) -> None:
        """Rewire back to the float graph (QAT never ran, so there are no ranges to export)."""
        for out, _, x in self._switches:
            _reroute(out, x)
        for t in self.targets:
            t.op._update_input(1, t.float_weight)

    def complete(self) -> None:
        """Rewire for inference and export: every switch to its quantized side, BatchNorms folded, each bias on
        the int32 grid its int8 layer holds it on (as ``recal_torch.export.bias_grid`` writes it)."""
        sources = {t.op.name: self._source(t.op.inputs[0]) for t in self.targets}
        for out, fq, _ in self._switches:
            _reroute(out, fq)
        for t in self.targets:
            source = sources[t.op.name]
            with tf_compat.name_scope(_scope(t.op) + "_folded"):
                if t.bn_infer is None:
                    t.op._update_input(1, t.folded_weight)
                    if t.bias is not None and source is not None:
                        index, b = next((i, b) for i, b in enumerate(t.bias.inputs) if b is not t.op.outputs[0])
                        t.bias._update_input(index, bias_on_int32_grid(b, t.float_weight, t.axis,
                                                                       *self._ranges[source.name],
                                                                       self.tables.weight_levels, t.learned_scale))
                    continue
                bn = t.bn_infer
                bias = bn.inputs[2] - bn.inputs[3] * t.scale
                if t.bias is not None:
                    b = [i for i in t.bias.inputs if i is not t.op.outputs[0]][0]
                    bias = bias + b * t.scale
                if source is not None:
                    bias = bias_on_int32_grid(bias, t.float_weight * t.scale, t.axis, *self._ranges[source.name],
                                              self.tables.weight_levels, t.learned_scale)
                attrs = {a: t.op.get_attr(a) for a in ("strides", "padding", "explicit_paddings", "dilations")}
                y = tf.raw_ops.Conv2D(input=t.op.inputs[0], filter=t.folded_weight, data_format="NHWC", **attrs)
                _reroute(t.pre_activation, tf.nn.bias_add(y, bias))


def _scope(op: tf.Operation) -> str:
    return op.name.replace("/", "_")


def _single_consumer(*tensors: tf.Tensor) -> tf.Operation | None:
    """The one op that consumes every tensor given and nothing else consumes them; else None."""
    users = {u.name: u for t in tensors for u in t.consumers()}
    return next(iter(users.values())) if len(users) == 1 else None


def _reroute(old: tf.Tensor, new: tf.Tensor, keep: set = frozenset(), only: list | None = None) -> None:
    """Every consumer of ``old`` (or those in ``only``) but those in ``keep`` reads ``new`` instead."""
    for op in list(old.consumers()) if only is None else only:
        if op in keep:
            continue
        for i, inp in enumerate(op.inputs):
            if inp is old:
                op._update_input(i, new)
