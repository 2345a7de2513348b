"""Learned quantization scales (LSQ, ``observer: lsq``) for recal's Keras QAT layers, on every Keras backend: the
variables of :mod:`recal_keras.lsq`'s rule. They are assigned in the forward pass, as observers are, but for
``log_ratio``, the one trainable variable (a JAX train step keeps only non-trainable variables assigned there).
"""

from __future__ import annotations

import warnings

import keras

from .lsq import LOG_RATIO, TINY, input_step, kernel_step, per_channel, per_tensor
from .qat import ActivationQuantizer
from .qat_math import qat_math
from .errors import RecalWarning


@keras.saving.register_keras_serializable(package="recal")
class LearnedActivationQuantizer(ActivationQuantizer):
    """A layer input's uint8 fake quantization whose scale is learned: started from the range the first QAT step
    observes (the zero point stays where it put it), trained while the observers would run."""

    def build(self, input_shape):
        super().build(input_shape)
        kwargs = {"shape": (), "initializer": "zeros", "aggregation": "only_first_replica"}
        self.start_scale = self.add_weight(name="start_scale", trainable=False, **kwargs)
        self.zero_point = self.add_weight(name="zero_point", trainable=False, **kwargs)
        self.log_ratio = self.add_weight(name=LOG_RATIO, trainable=True, **kwargs)

    def call(self, x, training=None):
        t, m = self.tables, qat_math()
        if t is None or t.export or not training:
            return super().call(x, training)
        observing = t.at(t.observing)
        first = m.ops.logical_and(observing, self.observed.value <= 0)  # the first QAT step: the range of the start
        self.observe(x, first)
        scale, zero, new = input_step(m.ops, first, self.min_val.value, self.max_val.value, self.start_scale.value,
                                      self.zero_point.value, self.log_ratio.value)
        self.start_scale.assign(new["start"])
        self.zero_point.assign(new["zero_point"])
        self.min_val.assign(m.pick(observing, new["min"], self.min_val.value))
        self.max_val.assign(m.pick(observing, new["max"], self.max_val.value))
        # (the log ratio in the graph either way: an optimizer warns of a variable without a gradient otherwise)
        return m.pick(observing, per_tensor(m.ops, x, scale, zero),
                      self.quantized(x, training) + 0.0 * self.log_ratio.value)


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
        self.log_ratio = self.add_weight(name=LOG_RATIO, trainable=True, **kwargs)
        self.current = self.add_weight(name="current", trainable=False, **kwargs)
        self.started = self.add_weight(name="started", shape=(), initializer="zeros", trainable=False,
                                       aggregation="only_first_replica")
        self.built = True

    def fake_quantize(self, w, axis: int, tables, levels: int, training):
        """``w`` on its per-channel int8 grid (``|q| <= levels``), LSQ's gradient to the learned scales while they
        train; the recorded scale otherwise (the backend's QDQ op in an export)."""
        k, m = keras.ops, qat_math()
        export = tables is not None and tables.export
        if export or tables is None or not training:
            with m.constants(export):  # an export's scale is a constant
                scale = k.maximum(self.current.value, TINY)
            return m.fake_quant_weight(w, axis, levels, export=export, scale=scale)
        scale, new = kernel_step(m.ops, tables.at(tables.observing), m.weight_scale(k.stop_gradient(w), axis, levels),
                                 self.start.value, self.started.value, self.current.value, self.log_ratio.value)
        for name, value in new.items():
            getattr(self, name).assign(value)
        return per_channel(m.ops, w, scale, axis, levels)

    def held(self, w):
        """``w`` as it is (QAT not on yet), the scales in the graph with a zero gradient: an optimizer warns of a
        variable without a gradient otherwise."""
        return w + 0.0 * keras.ops.sum(self.log_ratio.value)

    def call(self, w):
        return w


def no_decay_on_scales(optimizer, model: keras.Model) -> None:
    """Learned scales take no weight decay (recal_torch's param group of them has none). Keras's
    ``exclude_from_weight_decay`` resets the exclusions and refuses a built optimizer (one loaded with its model from a
    ``.keras`` file): the scales are added to the optimizer's own set, the user's exclusions kept, its cache cleared."""
    if not optimizer.weight_decay:
        return
    if not hasattr(optimizer, "_var_key"):
        warnings.warn(f"{type(optimizer).__name__} keeps no weight-decay exclusions recal knows: its weight decay also "
                      "decays the learned quantization scales", RecalWarning, stacklevel=4)
        return
    keys = {optimizer._var_key(v) for v in model.trainable_weights if v.name == LOG_RATIO}
    optimizer._exclude_from_weight_decay = set(getattr(optimizer, "_exclude_from_weight_decay", set())) | keys
    optimizer._exclude_from_weight_decay_cache = {}
