"""Learned quantization scales (LSQ, ``observer: lsq``) for recal's Keras QAT layers, on every Keras backend.

A scale learns as ``start * exp(log_ratio)``: ``start`` is set from what the first QAT step observes (a
non-trainable variable, assigned in the forward pass as observers are), ``log_ratio`` is trainable and starts at
0, so the optimizer sees an ordinary variable from the first step on (a JAX train step keeps only non-trainable
variables assigned in the forward pass). In log space because a Keras optimizer takes one learning rate for every
variable (recal_torch gives the scales a param group and ``lr_factor`` of their own): Adam moves a variable by
about its learning rate a step whatever its size, which would take a scale of 0.002 to zero and below within a
few dozen steps at a weight's rate, while a step moves ``log_ratio`` by a relative amount and the scale stays
positive. The gradient is LSQ's, scaled by ``1 / sqrt(values * levels)``, written
with ``stop_gradient`` (:func:`recal_tf.tensor_ops.lsq`, the graph API's too), so TensorFlow, JAX and PyTorch
compute the same. While the observers
run the scale trains and its value is copied to the variables the rest of QAT reads (an activation's
``min_val`` / ``max_val``; a kernel's ``current`` scale); once they are frozen the forward pass reads those copies,
so the optimizer's momentum moving ``delta`` afterwards changes nothing, and export, the bias grid and a
saved model use them as they use an observed range.
"""

from __future__ import annotations

import math

import keras
import numpy as np

from ..tensor_ops import lsq
from .qat import ActivationQuantizer
from .qat_math import qat_math

TINY = 1e-8  # a scale never reaches 0 (the grid's division), whatever a step does to it


@keras.saving.register_keras_serializable(package="recal")
class LearnedActivationQuantizer(ActivationQuantizer):
    """A layer input's uint8 fake quantization whose scale is learned: started from the range the first QAT step
    observes (the zero point stays where it put it), trained while the observers would run."""

    def build(self, input_shape):
        super().build(input_shape)
        kwargs = {"shape": (), "initializer": "zeros", "aggregation": "only_first_replica"}
        self.start_scale = self.add_weight(name="start_scale", trainable=False, **kwargs)
        self.zero_point = self.add_weight(name="zero_point", trainable=False, **kwargs)
        self.log_ratio = self.add_weight(name="log_ratio", trainable=True, **kwargs)

    def call(self, x, training=None):
        t, m = self.tables, qat_math()
        if t is None or t.export or not training:
            return super().call(x, training)
        k = keras.ops
        observing, started = t.at(t.observing), self.observed.value > 0
        first = k.logical_and(observing, k.logical_not(started))  # the first QAT step: the start
        self.observe(x, first)
        low = k.minimum(self.min_val.value, 0.0)
        start = (k.maximum(self.max_val.value, low + 1e-6) - low) / 255.0
        self.start_scale.assign(m.pick(first, start, self.start_scale.value))
        self.zero_point.assign(m.pick(first, k.clip(k.round(-low / start), 0.0, 255.0), self.zero_point.value))
        scale = k.maximum(self.start_scale.value * k.exp(self.log_ratio.value), TINY)
        zero_point = self.zero_point.value
        values = float(np.prod([d for d in x.shape[1:] if d is not None]) or 1)
        learned = lsq(m.ops, x, scale, zero_point, 0.0, 255.0, 1.0 / math.sqrt(values * 255.0))
        held = k.stop_gradient(scale)  # what eval, export and the frozen observers read: the learned grid
        self.min_val.assign(m.pick(observing, -zero_point * held, self.min_val.value))
        self.max_val.assign(m.pick(observing, (255.0 - zero_point) * held, self.max_val.value))
        # (the log ratio in the graph either way: an optimizer warns of a variable without a gradient otherwise)
        return m.pick(observing, learned, self.quantized(x, training) + 0.0 * self.log_ratio.value)


@keras.saving.register_keras_serializable(package="recal")
class LearnedWeightScales(keras.layers.Layer):
    """A kernel's per-output-channel int8 scales, learned: started from ``max|w| / levels`` at the first QAT step,
    trained while the observers would run; ``current`` holds the scale the layer quantizes with otherwise."""

    def __init__(self, channels: int, **kwargs):
        kwargs.setdefault("dtype", "float32")
        super().__init__(**kwargs)
        self.channels = channels
        self.build()  # its variables exist with the QAT layer's (it is used through its methods, never called)

    def get_config(self) -> dict:
        return {**super().get_config(), "channels": self.channels}

    def build(self, input_shape=None):
        kwargs = {"shape": (self.channels,), "initializer": "zeros", "aggregation": "only_first_replica"}
        self.start = self.add_weight(name="start", trainable=False, **kwargs)
        self.log_ratio = self.add_weight(name="log_ratio", trainable=True, **kwargs)
        self.current = self.add_weight(name="current", trainable=False, **kwargs)
        self.started = self.add_weight(name="started", shape=(), initializer="zeros", trainable=False,
                                       aggregation="only_first_replica")
        self.built = True

    def training_scale(self, w, axis: int, tables, levels: int, training):
        """The scale a training forward pass quantizes ``w`` with: the learned one while the observers would run
        (recorded in ``current``), the recorded one after."""
        m, k = qat_math(), keras.ops
        observing = tables.at(tables.observing)
        first = k.logical_and(observing, k.equal(self.started.value, 0.0))
        start = m.weight_scale(k.stop_gradient(w), axis, levels)
        self.start.assign(m.pick(first, start, self.start.value))
        self.started.assign(m.pick(observing, k.ones_like(self.started.value), self.started.value))
        learned = k.maximum(self.start.value * k.exp(self.log_ratio.value), TINY)
        self.current.assign(m.pick(observing, k.stop_gradient(learned), self.current.value))
        return m.pick(observing, learned, k.maximum(self.current.value, TINY) + 0.0 * self.log_ratio.value)

    def fake_quantize(self, w, axis: int, tables, levels: int, training):
        """``w`` on its per-channel int8 grid (``|q| <= levels``), LSQ's gradient to the learned scales while they
        train; the recorded scale otherwise (the backend's QDQ op in an export)."""
        k, m = keras.ops, qat_math()
        export = tables is not None and tables.export
        if export or tables is None or not training:
            with m.constants(export):  # an export's scale is a constant
                scale = k.maximum(self.current.value, TINY)
            return m.fake_quant_weight(w, axis, levels, export=export, scale=scale)
        scale = self.training_scale(w, axis, tables, levels, training)
        shape = [1] * len(w.shape)
        shape[axis] = -1
        per_value = float(np.prod(w.shape) // w.shape[axis])
        return lsq(m.ops, w, k.reshape(scale, shape), 0.0, -float(levels), float(levels),
                   1.0 / math.sqrt(per_value * levels))

    def held(self, w):
        """``w`` as it is (QAT not on yet), the scales in the graph with a zero gradient: an optimizer warns of a
        variable without a gradient otherwise."""
        return w + 0.0 * keras.ops.sum(self.log_ratio.value)

    def call(self, w):
        return w
