"""Quantization-aware training for Keras 3, with recal_torch's conventions (the math: :mod:`recal_keras.fake_quant`).

- ``Conv2D`` / ``DepthwiseConv2D`` / ``SeparableConv2D(-BatchNormalization)(-ReLU / ReLU6)`` and ``Dense(-ReLU /
  ReLU6)`` become one :class:`~recal_keras.quantized_layer.QuantizedLayer` simulating the BatchNorm-folded weights
  (batch statistics while training, the moving ones once frozen), weights per output channel; it quantizes its
  output (the ReLU folded into the range) and its input unless another quantized layer made it (through pooling,
  padding, flatten, reshape or dropout). A sigmoid or swish after it runs on the integers too (QLinearSigmoid,
  QLinearMul); a hard-swish or hard-sigmoid is quantized before and after as a whole (a table of its input's
  integers).
- A residual ``Add``, a ``Multiply``, a ``Concatenate`` of quantized tensors (and the ReLU after an Add), an
  ``AveragePooling2D`` of one and a pre-activation ``BatchNormalization`` with its ReLU become a
  :class:`QuantizedMerge`: one observer on its output, so the int8 model computes it on the integers.
- ``observer: lsq`` learns the weights' and inputs' scales (:mod:`recal_keras.learned_scales`).

What each layer becomes is planned in :mod:`recal_keras.qat_plan`; :mod:`recal_keras.qat_model` builds the new
model around the original layers (their variables, masks and optimizer state) with ``keras.models.clone_model``.
The layers are registered Keras serializables: ``model.save("x.keras")`` writes a QAT model, ``load_model`` gives one
that computes what it computed (BatchNorm and observers frozen), and ``modify`` takes it on again to resume.
"""

from __future__ import annotations


import keras
import numpy as np

from recal_core.modifiers import REDUCED_WEIGHT_LEVELS, WEIGHT_LEVELS

from .qat_tables import QATTables
from .qat_math import qat_math


@keras.saving.register_keras_serializable(package="recal")
class ActivationQuantizer(keras.layers.Layer):
    """uint8 fake quantization of one tensor with a moving-average min/max observer (in float32, under any
    dtype policy: ``FakeQuantWithMinMaxVars`` takes float32 only; the ops per backend: :mod:`.qat_math`)."""

    def __init__(self, **kwargs):
        kwargs.setdefault("dtype", "float32")
        super().__init__(**kwargs)
        self.tables: QATTables | None = None

    def build(self, input_shape):
        # every replica computes the same update from the all-reduced batch range: the first one's is kept
        kwargs = {"shape": (), "initializer": "zeros", "trainable": False, "aggregation": "only_first_replica"}
        self.min_val = self.add_weight(name="min_val", **kwargs)
        self.max_val = self.add_weight(name="max_val", **kwargs)
        self.observed = self.add_weight(name="observed", **kwargs)

    def call(self, x, training=None):
        t, m = self.tables, qat_math()
        if t is None or t.export:
            return m.fake_quant_activation(x, self.min_val.value, self.max_val.value, export=True)
        if training:
            self.observe(x, t.at(t.observing))
        return self.quantized(x, training)

    def observe(self, x, when) -> None:
        """Move the range towards ``x``'s (the batch's own the first time) where ``when`` holds."""
        m = qat_math()
        low, high = m.global_range(x)
        new_min, new_max = m.moving_range(low, high, self.min_val.value, self.max_val.value, self.observed.value > 0)
        self.min_val.assign(m.pick(when, new_min, self.min_val.value))
        self.max_val.assign(m.pick(when, new_max, self.max_val.value))
        self.observed.assign(m.pick(when, m.ones_like(self.observed.value), self.observed.value))

    def quantized(self, x, training):
        """``x`` on the grid of the range held, while QAT is on. Until a training step has observed a range there is
        none to quantize with (an evaluation at the step QAT starts, such as Keras's validation at the end of the
        epoch before it): the tensor passes as it is."""
        t, m = self.tables, qat_math()
        on = t.at(t.enabled) if training else keras.ops.logical_and(t.at(t.enabled), self.observed.value > 0)
        return m.pick(on, m.fake_quant_activation(x, self.min_val.value, self.max_val.value), x)

    def compute_output_shape(self, input_shape):
        return input_shape


def input_source(layer):
    """The output quantizer of ``layer.source`` (the QAT layer whose quantized output it reads), found upstream by
    name (a loaded model: the layers are rebuilt apart, linked once the model has called them); None if unknown."""
    if layer.input_source is None and layer.source is not None:
        seen, nodes = set(), list(layer._inbound_nodes)
        while nodes:
            for parent in nodes.pop().parent_nodes:
                op = parent.operation
                if op.name == layer.source and isinstance(getattr(op, "output_quantizer", None), ActivationQuantizer):
                    object.__setattr__(layer, "input_source", op.output_quantizer)
                    return layer.input_source
                if id(op) not in seen:
                    seen.add(id(op))
                    nodes.extend(op._inbound_nodes)
    return layer.input_source


def batchnorm_parameters(bn) -> tuple:
    """A BatchNormalization's ``(gamma, beta, moving mean, moving variance)``, ones and zeros where it has no scale or
    no center."""
    mean, var, m = bn.moving_mean.value, bn.moving_variance.value, qat_math()
    return (bn.gamma.value if bn.scale else m.ones_like(mean), bn.beta.value if bn.center else m.zeros_like(mean),
            mean, var)


def tables_state(t: QATTables | None) -> dict:
    """What a QAT layer saved to a ``.keras`` file does now: quantize or not yet (the recipe's switch at the
    current step), or compute the export's form once finalized; and its weights' levels."""
    return {"weight_levels": WEIGHT_LEVELS if t is None else int(t.weight_levels),
            "quantizing": t is None or t.export or bool(np.asarray(keras.ops.convert_to_numpy(
                t.at(t.enabled, t.iterations)))),  # the optimizer's step (saved between steps)
            "finalized": t is not None and t.export}


# activations quantized before and after as a whole (the int8 model: a table of the input's integers)
TABLED = {"hard_swish": keras.activations.hard_silu, "hard_sigmoid": keras.activations.hard_sigmoid}


def fixed_tables(config: dict) -> QATTables:
    """The tables a loaded QAT layer keeps until a manager takes it on (its :func:`tables_state` keys popped)."""
    return QATTables.fixed(config.pop("quantizing"), config.pop("finalized"), config.pop("weight_levels"),
                           ops=qat_math().ops)


def channels_last(y, layout: str):
    """``y`` back in the model's channels-last layout."""
    return qat_math().transpose(y, (0, 2, 3, 1)) if layout == "channels_first" else y


@keras.saving.register_keras_serializable(package="recal")
class QuantizedMerge(keras.layers.Layer):
    """A layer without a conv of its own on quantized tensors, its output quantized: a residual ``Add`` (with the ReLU
    after it folded in), a ``Multiply``, a ``Concatenate``, an ``AveragePooling2D`` or a pre-activation
    ``BatchNormalization`` (with its ReLU). The int8 model computes it on the integers (QLinearAdd, QLinearMul,
    QLinearConcat, QLinearAveragePool, a depthwise QLinearConv) rather than leave it float between quantized layers.
    ``observe_inputs``: per input, whether the merge observes it itself, because ops the layer graph does not hold
    made it (MobileNetV3's squeeze-excitation gate, ``ReLU(6)(x + 3) * (1 / 6)``: the converter makes that a table)."""

    def __init__(self, layer, relu: bool | float = False, source: str | None = None,
                 observe_inputs: list[bool] | None = None, **kwargs):
        kwargs.setdefault("dtype", "float32")
        kwargs.setdefault("name", f"{layer.name}_qat")
        super().__init__(**kwargs)
        self.layer, self.relu = layer, relu
        self.input_quantizer = None  # its inputs are quantized where they are made, or by input_observers
        self.observe_inputs = [bool(flag) for flag in observe_inputs or []]
        self.input_observers = [ActivationQuantizer(name=f"{layer.name}_input{i}_q")
                                for i, flag in enumerate(self.observe_inputs) if flag]
        self.source = source  # a BatchNorm's: the QAT layer whose quantized output it reads
        object.__setattr__(self, "input_source", None)  # that layer's output quantizer, once found
        self.output_quantizer = ActivationQuantizer(name=f"{layer.name}_output_q")
        self.tables: QATTables | None = None

    @property
    def quantizers(self) -> list[ActivationQuantizer]:
        """Its observers: the inputs it observes itself, then the output."""
        return [*self.input_observers, self.output_quantizer]

    def set_tables(self, tables: QATTables) -> None:
        self.tables = tables
        for q in self.quantizers:
            q.tables = tables

    def get_config(self) -> dict:
        return {**super().get_config(), "layer": keras.saving.serialize_keras_object(self.layer), "relu": self.relu,
                "source": self.source, "observe_inputs": self.observe_inputs, **tables_state(self.tables)}

    @classmethod
    def from_config(cls, config: dict) -> "QuantizedMerge":
        config = dict(config)
        tables = fixed_tables(config)
        merge = cls(keras.saving.deserialize_keras_object(config.pop("layer")), **config)
        merge.set_tables(tables)
        return merge

    def build(self, input_shape):
        if not self.layer.built:  # a pre-activation BatchNorm's variables (a loaded model's too)
            self.layer.build(input_shape)
        for q in self.quantizers:
            q.build(None)

    def compute_output_shape(self, input_shape):
        return self.layer.compute_output_shape(input_shape)

    def call(self, inputs, training=None, mask=None):
        t = self.tables
        if self.input_observers:
            observers = iter(self.input_observers)
            inputs = [next(observers)(x, training=training) if flag else x
                      for x, flag in zip(inputs, self.observe_inputs)]
        if isinstance(self.layer, keras.layers.BatchNormalization) and t is not None and t.export:
            y = self._batchnorm_on_grid(inputs)
        else:  # a BatchNorm normalizes with the batch's statistics in training
            y = self.layer(inputs, training=training)
        y = folded_relu(y, self.relu)
        return self.output_quantizer(y, training=training)  # y itself while QAT is off

    def _batchnorm_on_grid(self, x):
        """A pre-activation BatchNorm as the int8 model computes it (recal_onnx's ``batchnorm_to_conv``): ``x * a``
        exactly (``a`` held as +-64 at scale ``|a| / 64``; a zero factor as 0 at scale 1), plus the shift on its
        int32 grid of input scale x that weight scale."""
        m = qat_math()
        with m.constants():
            gamma, beta, mean, var = batchnorm_parameters(self.layer)
            a = gamma / m.sqrt(var + self.layer.epsilon)
            shift = beta - mean * a
            source = input_source(self)
            if source is not None:
                as_weight = m.where(a == 0, float(REDUCED_WEIGHT_LEVELS), a)  # |w| / 64 is the weight scale
                shift = m.bias_on_int32_grid(shift, as_weight, 0, source.min_val.value, source.max_val.value,
                                             REDUCED_WEIGHT_LEVELS)
        return x * a + shift


@keras.saving.register_keras_serializable(package="recal")
class Folded(keras.layers.Layer):
    """Where a BatchNormalization or ReLU folded into the quantized layer before it was: passes its input on
    (in float32, as the quantized layer computes)."""

    def __init__(self, **kwargs):
        kwargs.setdefault("dtype", "float32")
        super().__init__(**kwargs)

    def call(self, x, training=None, mask=None):
        return x

    def compute_output_shape(self, input_shape):
        return input_shape


def folded_relu(y, relu: bool | float):
    """``y`` through the ReLU a QAT layer folds: none (False), ReLU (True) or ReLU6 (6.0)."""
    return y if not relu else qat_math().relu(y) if relu is True else qat_math().relu6(y)
