"""Quantization-aware training for Keras 3, with recal_torch's conventions (the math: :mod:`recal_keras.fake_quant`).

- ``Conv2D`` / ``DepthwiseConv2D`` / ``SeparableConv2D(-BatchNormalization)(-ReLU / ReLU6)`` and ``Dense(-ReLU /
  ReLU6)`` become one :class:`QuantizedLayer` simulating the BatchNorm-folded weights (batch statistics while
  training, the moving ones once frozen), weights per output channel; it quantizes its output (the ReLU folded into
  the range) and its input unless another quantized layer made it (through pooling, padding, flatten, reshape or
  dropout). A sigmoid or swish after it runs on the integers too (QLinearSigmoid, QLinearMul); a hard-swish or
  hard-sigmoid is quantized before and after as a whole (a table of its input's integers).
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

import contextlib

import keras
import numpy as np

from recal_core.modifiers import REDUCED_WEIGHT_LEVELS, WEIGHT_LEVELS

from .qat_tables import QATTables
from .qat_math import qat_math
from .qat_plan import INTEGER_ACTIVATIONS, activation_relu


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


def _input_source(layer):
    """The output quantizer of ``layer.source`` (the QAT layer whose quantized output it reads), found upstream by
    name (a loaded model: the layers are rebuilt apart, linked once the model has called them); None if unknown."""
    if layer.input_source is None and layer.source is not None:
        seen, nodes = set(), list(layer._inbound_nodes)
        while nodes:
            for parent in nodes.pop().parent_nodes:
                op = parent.operation
                if op.name == layer.source and isinstance(op, (QuantizedLayer, QuantizedMerge)):
                    object.__setattr__(layer, "input_source", op.output_quantizer)
                    return layer.input_source
                if id(op) not in seen:
                    seen.add(id(op))
                    nodes.extend(op._inbound_nodes)
    return layer.input_source


def _batchnorm_parameters(bn) -> tuple:
    """A BatchNormalization's ``(gamma, beta, moving mean, moving variance)``, ones and zeros where it has no scale or
    no center."""
    mean, var, m = bn.moving_mean.value, bn.moving_variance.value, qat_math()
    return (bn.gamma.value if bn.scale else m.ones_like(mean), bn.beta.value if bn.center else m.zeros_like(mean),
            mean, var)


def _state(t: QATTables | None) -> dict:
    """What a QAT layer saved to a ``.keras`` file does now: quantize or not yet (the recipe's switch at the
    current step), or compute the export's form once finalized; and its weights' levels."""
    return {"weight_levels": WEIGHT_LEVELS if t is None else int(t.weight_levels),
            "quantizing": t is None or t.export or bool(np.asarray(keras.ops.convert_to_numpy(
                t.at(t.enabled, t.iterations)))),  # the optimizer's step (saved between steps)
            "finalized": t is not None and t.export}


# activations quantized before and after as a whole (the int8 model: a table of the input's integers)
TABLED = {"hard_swish": keras.activations.hard_silu, "hard_sigmoid": keras.activations.hard_sigmoid}


def _fixed_tables(config: dict) -> QATTables:
    """The tables a loaded QAT layer keeps until a manager takes it on (its :func:`_state` keys popped)."""
    return QATTables.fixed(config.pop("quantizing"), config.pop("finalized"), config.pop("weight_levels"),
                           ops=qat_math().ops)


@keras.saving.register_keras_serializable(package="recal")
class QuantizedLayer(keras.layers.Layer):
    """A Conv2D, DepthwiseConv2D or Dense with its BatchNormalization (convs) and ReLU or ReLU6 (``relu`` True or
    6.0) folded in, fake-quantized; or followed by a sigmoid, swish, hard-swish or hard-sigmoid (``activation``)
    computed on quantized tensors.
    It computes in float32 under any dtype policy (``mixed_float16`` too): the int8 model it stands for holds exact
    levels, which float16 cannot."""

    def __init__(self, layer, bn=None, relu: bool | float = False, quantize_input: bool = True,
                 source: str | None = None, activation: str | None = None, learn: tuple[bool, bool] = (False, False),
                 **kwargs):
        kwargs.setdefault("dtype", "float32")
        kwargs.setdefault("name", f"{layer.name}_qat")
        super().__init__(**kwargs)
        if activation is not None and activation not in INTEGER_ACTIVATIONS.values():
            raise ValueError(f"{layer.name}: activation must be None or one of "
                             f"{sorted(set(INTEGER_ACTIVATIONS.values()))}, not {activation!r}")
        self.layer, self.bn, self.relu, self.activation = layer, bn, relu, activation
        self.learn = tuple(bool(f) for f in learn)  # (weights, input): learned scales (.learned_scales)
        # learned scales (.learned_scales builds on this module): by the names they are registered under
        quantizer = keras.saving.get_registered_object("recal>LearnedActivationQuantizer") if self.learn[1] else \
            ActivationQuantizer
        self.input_quantizer = quantizer(name=f"{layer.name}_input_q") if quantize_input else None
        self.weight_scales = self.depthwise_scales = None  # learned weights' scales, made in build
        # with an activation: the layer's own output (the activation's input), its sigmoid (swish: the sigmoid
        # apart, then the product); output_quantizer is always the tensor the next layer reads
        self.linear_quantizer = ActivationQuantizer(name=f"{layer.name}_linear_q") if activation else None
        # a SeparableConv2D's depthwise output, the pointwise conv's input: int8 between the two convs
        self.depthwise_quantizer = ActivationQuantizer(name=f"{layer.name}_depthwise_q") \
            if isinstance(layer, keras.layers.SeparableConv2D) else None
        self.sigmoid_quantizer = ActivationQuantizer(name=f"{layer.name}_sigmoid_q") if activation == "swish" else None
        self.output_quantizer = ActivationQuantizer(name=f"{layer.name}_output_q")
        self.tables: QATTables | None = None
        self.source = source  # the QuantizedLayer whose quantized output this one reads, when not its own input's
        object.__setattr__(self, "input_source", None)  # that layer's output quantizer, once found
        self.step_counter = None  # JAX: see count_steps
        self._spatial = None  # the input's height and width, once built

    def get_config(self) -> dict:
        """The inner layer and BatchNorm, how the layer quantizes, and what it does now: quantize or not yet
        (the recipe's switch at the current step), or compute the export's form once finalized."""
        serialize = keras.saving.serialize_keras_object
        return {**super().get_config(), "layer": serialize(self.layer),
                "bn": None if self.bn is None else serialize(self.bn), "relu": self.relu,
                "quantize_input": self.input_quantizer is not None, "source": self.source,
                "activation": self.activation, "learn": list(self.learn), **_state(self.tables)}

    @classmethod
    def from_config(cls, config: dict) -> "QuantizedLayer":
        config = dict(config)
        deserialize = keras.saving.deserialize_keras_object
        layer = deserialize(config.pop("layer"))  # built from its own build config, under its own name
        bn = config.pop("bn")
        bn = None if bn is None else deserialize(bn)
        tables = _fixed_tables(config)
        q = cls(layer, bn, **config)
        q.set_tables(tables)
        return q

    @property
    def quantizers(self) -> list[ActivationQuantizer]:
        """Every observer of the layer, in the order its tensors are computed."""
        return [q for q in (self.input_quantizer, self.depthwise_quantizer, self.linear_quantizer,
                            self.sigmoid_quantizer, self.output_quantizer) if q is not None]

    def set_tables(self, tables: QATTables) -> None:
        self.tables = tables
        for q in self.quantizers:
            q.tables = tables

    def count_steps(self, tables: QATTables, iterations) -> None:
        """Keep the step count the QAT switches read in a variable of this layer, the model's first QAT layer, which
        every forward pass runs before the others. A JAX forward pass reads the model's variables only, not the
        optimizer's ``iterations``; the count is a training forward pass's, set to ``iterations`` whenever recal's
        callback starts an epoch, and is not saved (a ``.keras`` file holds the same variables on every backend)."""
        self._tracker.unlock()
        try:
            self.step_counter = self.add_weight(name="recal_step", shape=(), dtype="int32", trainable=False,
                                                initializer=keras.initializers.Constant(int(iterations.numpy())))
        finally:
            self._tracker.lock()
        tables.counter = self.step_counter

    def save_own_variables(self, store):
        with self._without_step_counter():
            super().save_own_variables(store)

    def load_own_variables(self, store):
        with self._without_step_counter():
            super().load_own_variables(store)

    @contextlib.contextmanager
    def _without_step_counter(self):  # (not through Keras's setattr: it would track a copy of the list, and a
        held = self._non_trainable_variables  # variable added later, a loaded model's step count, would miss it)
        object.__setattr__(self, "_non_trainable_variables", [v for v in held if v is not self.step_counter])
        try:
            yield
        finally:
            object.__setattr__(self, "_non_trainable_variables", held)

    def _read_step(self, t: QATTables, training) -> None:
        """Set the step the switches read in this forward pass: the steps done before it (a training pass counts
        itself first)."""
        counter = self.step_counter
        if training:
            counter.assign(counter.value + 1)
            t.current = counter.value - 1
        else:
            t.current = counter.value

    def build(self, input_shape):
        if len(input_shape) == 4:
            self._spatial = tuple(input_shape[1:3])
        if not self.layer.built:
            self.layer.build(input_shape)
        if self.bn is not None and not self.bn.built:
            self.bn.build(self.layer.compute_output_shape(input_shape))
        if self.input_quantizer is not None:
            self.input_quantizer.build(input_shape)
        for q in self.quantizers[1 if self.input_quantizer is not None else 0:]:
            q.build(None)
        if self.learn[0]:
            LearnedWeightScales = keras.saving.get_registered_object("recal>LearnedWeightScales")
            kernel = self.layer.pointwise_kernel if self.depthwise_quantizer is not None else self.layer.kernel
            self.weight_scales = LearnedWeightScales(kernel.shape[2 if self._depthwise else -1],
                                                     name=f"{self.layer.name}_weight_scales")
            if self.depthwise_quantizer is not None:
                self.depthwise_scales = LearnedWeightScales(self.layer.depthwise_kernel.shape[2],
                                                            name=f"{self.layer.name}_depthwise_scales")

    def compute_output_shape(self, input_shape):
        """The inner layer's: Keras would otherwise trace :meth:`call` to find it (3 s a MobileNetV2 clone)."""
        return self.layer.compute_output_shape(input_shape)

    @property
    def _depthwise(self) -> bool:
        return isinstance(self.layer, keras.layers.DepthwiseConv2D)

    def _per_channel(self, v):
        """A per-output-channel vector shaped to scale the kernel (a depthwise kernel is [h, w, channels, 1])."""
        return v[:, None] if self._depthwise else v

    def _linear(self, x, w, layout: str):
        m = qat_math()
        if isinstance(self.layer, keras.layers.Dense):
            return m.dense(x, w)
        conv = self.layer
        if self.depthwise_quantizer is not None:  # the pointwise half of a SeparableConv2D
            return m.conv(x, w, data_format=layout)
        x, padding = self._padded(x, layout)
        if self._depthwise:
            return m.depthwise_conv(x, w, conv.strides, padding, conv.dilation_rate, data_format=layout)
        return m.conv(x, w, conv.strides, padding, conv.dilation_rate, data_format=layout)

    def _padded(self, x, layout: str):
        """``(x, padding)``; channels-first (an export from JAX or PyTorch), a ``"same"`` conv's zero padding as an
        explicit pad of constant sizes from the layer's built input shape: PyTorch's exporter would write sizes computed
        from the traced input's shape, a Pad the int8 converter cannot fold into the conv."""
        conv, spatial = self.layer, self._spatial
        if layout != "channels_first" or conv.padding != "same" or spatial is None or None in spatial:
            return x, conv.padding
        pads = [[0, 0], [0, 0]]
        for size, kernel, stride, dilation in zip(spatial, conv.kernel_size, conv.strides, conv.dilation_rate):
            total = max((-(-size // stride) - 1) * stride + (kernel - 1) * dilation + 1 - size, 0)
            pads.append([total // 2, total - total // 2])
        return qat_math().pad(x, pads), "valid"

    def _layout(self) -> str:
        """``channels_first`` for a conv in a finalized model on JAX or PyTorch: their exporters would otherwise write
        each conv between two Transposes, with the bias added after the second, where the int8 converter cannot
        fold it; computed channels-first, the export reads ``Transpose, QDQ, Conv, Add(bias), QDQ, Transpose``, and
        the Transposes between two layers cancel."""
        t = self.tables
        exporting = t is not None and t.export and qat_math().exports_channels_first
        return "channels_first" if exporting and not isinstance(self.layer, keras.layers.Dense) else "channels_last"

    def call(self, x, training=None, mask=None):
        t, m = self.tables, qat_math()
        if self.step_counter is not None and t is not None and not t.export:
            self._read_step(t, training)
        layout = self._layout()
        if self.input_quantizer is not None:
            x = self.input_quantizer(x, training=training)
        if layout == "channels_first":
            x = m.transpose(x, (0, 3, 1, 2))
        if self.depthwise_quantizer is not None:
            x = self.depthwise_quantizer(self._separable_depthwise(x, layout, training), training=training)
            w = self.layer.pointwise_kernel.value  # [1, 1, channels, filters]: BN and bias fold in here
        else:
            w = self.layer.kernel.value  # a depthwise kernel is [h, w, channels, 1]
        axis = 2 if self._depthwise else len(w.shape) - 1  # the output channels
        if self.bn is not None and training and t is not None and not t.export:
            return self._train_with_batchnorm(x, w, axis, layout, training)
        with m.constants(t is not None and t.export):
            w, bias = self._folded(w, axis, layout)
        return self._activate(self._linear(x, self._quantize(w, axis, training), layout) + bias, training, layout)

    def _bias(self, w, axis: int):
        return self.layer.bias.value if self.layer.use_bias else qat_math().zeros(w.shape[axis], w.dtype)

    def _train_with_batchnorm(self, x, w, axis: int, layout: str, training):
        """As torch.ao's ConvBn trains: the weights folded with the moving std, then the output rescaled and
        batch-normalised with the batch statistics (gradients through them) until BatchNorm is frozen."""
        t, m, bn = self.tables, qat_math(), self.bn
        gamma, beta, mean, var = _batchnorm_parameters(bn)
        scale = gamma / m.sqrt(var + bn.epsilon)
        y = self._linear(x, self._quantize(w * self._per_channel(scale), axis, training), layout) / scale + \
            self._bias(w, axis)
        batch_mean, batch_var = m.moments(y)
        frozen = t.at(t.bn_frozen)
        momentum = bn.momentum
        global_mean, global_var = m.global_moments(m.stop_gradient(batch_mean), m.stop_gradient(batch_var))
        bn.moving_mean.assign(m.pick(frozen, mean, mean * momentum + global_mean * (1 - momentum)))
        bn.moving_variance.assign(m.pick(frozen, var, var * momentum + global_var * (1 - momentum)))
        use_mean, use_var = m.pick(frozen, mean, batch_mean), m.pick(frozen, var, batch_var)
        return self._activate(gamma * (y - use_mean) / m.sqrt(use_var + bn.epsilon) + beta, training, layout)

    def _folded(self, w, axis: int, layout: str):
        """``(kernel, bias)`` with the BatchNorm's moving statistics folded in; in a finalized model the bias on the
        int32 grid of input scale x weight scale, shaped for ``layout``."""
        t, m = self.tables, qat_math()
        bias = self._bias(w, axis)
        if self.bn is not None:
            gamma, beta, mean, var = _batchnorm_parameters(self.bn)
            scale = gamma / m.sqrt(var + self.bn.epsilon)
            bias = beta + (bias - mean) * scale
            w = w * self._per_channel(scale)
        source = self.depthwise_quantizer or self.input_quantizer or _input_source(self)  # unknown: bias as it is
        if t is not None and t.export and source is not None:
            learned = None if self.weight_scales is None else self.weight_scales.current.value
            bias = m.bias_on_int32_grid(bias, w, axis, source.min_val.value, source.max_val.value, t.weight_levels,
                                        weight_scale=learned)
        return w, m.reshape(bias, (-1, 1, 1)) if layout == "channels_first" else bias

    def _separable_depthwise(self, x, layout: str, training=None):
        """A SeparableConv2D's depthwise half, its kernel fake-quantized per channel (no bias: Keras adds its one
        bias after the pointwise conv)."""
        conv = self.layer
        dq = self._quantize(conv.depthwise_kernel.value, 2, training, self.depthwise_scales)
        x, padding = self._padded(x, layout)
        return qat_math().depthwise_conv(x, dq, conv.strides, padding, conv.dilation_rate, data_format=layout)

    def _quantize(self, w, axis: int, training=None, scales=None):
        t, m = self.tables, qat_math()
        export, levels = t is not None and t.export, t.weight_levels if t is not None else WEIGHT_LEVELS
        scales = scales or self.weight_scales  # learned (the separable depthwise kernel's given), or None
        wq = scales.fake_quantize(w, axis, t, levels, training) if scales is not None else \
            m.fake_quant_weight(w, axis, levels, export=export)
        return wq if t is None or export else m.pick(t.at(t.enabled), wq, w if scales is None else scales.held(w))

    def _activate(self, y, training, layout: str = "channels_last"):
        y = _folded_relu(y, self.relu)
        if self.activation is not None:  # on the quantized output: QLinearSigmoid (and QLinearMul) in the int8 model
            y = self.linear_quantizer(y, training=training)
            if self.activation in TABLED:
                return _channels_last(self.output_quantizer(TABLED[self.activation](y), training=training), layout)
            s = qat_math().sigmoid(y)
            if self.activation == "sigmoid":
                y = self.output_quantizer(s, training=training)
            else:
                y = self.output_quantizer(y * self.sigmoid_quantizer(s, training=training), training=training)
            return _channels_last(y, layout)
        y = _channels_last(self.output_quantizer(y, training=training), layout)
        after = self.layer.activation  # one that does not fold (softmax, hard-swish...) runs after, in float
        return y if activation_relu(after) is not None else after(y)


def _channels_last(y, layout: str):
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
                "source": self.source, "observe_inputs": self.observe_inputs, **_state(self.tables)}

    @classmethod
    def from_config(cls, config: dict) -> "QuantizedMerge":
        config = dict(config)
        tables = _fixed_tables(config)
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
        y = _folded_relu(y, self.relu)
        return self.output_quantizer(y, training=training)  # y itself while QAT is off

    def _batchnorm_on_grid(self, x):
        """A pre-activation BatchNorm as the int8 model computes it (recal_onnx's ``batchnorm_to_conv``): ``x * a``
        exactly (``a`` held as +-64 at scale ``|a| / 64``; a zero factor as 0 at scale 1), plus the shift on its
        int32 grid of input scale x that weight scale."""
        m = qat_math()
        with m.constants():
            gamma, beta, mean, var = _batchnorm_parameters(self.layer)
            a = gamma / m.sqrt(var + self.layer.epsilon)
            shift = beta - mean * a
            source = _input_source(self)
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


def _folded_relu(y, relu: bool | float):
    """``y`` through the ReLU a QAT layer folds: none (False), ReLU (True) or ReLU6 (6.0)."""
    return y if not relu else qat_math().relu(y) if relu is True else qat_math().relu6(y)
