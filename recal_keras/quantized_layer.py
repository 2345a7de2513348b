"""The Keras QAT layer that stands in for a ``Conv2D`` / ``DepthwiseConv2D`` / ``SeparableConv2D`` / ``Dense`` (with
its BatchNorm and activation): BatchNorm-folded weights on their int8 grid, its input and output quantized
(:mod:`recal_keras.qat` says what each layer becomes and holds the pieces it shares with the others)."""

from __future__ import annotations

import contextlib

import keras

from recal_core.modifiers import WEIGHT_LEVELS

from .qat import (TABLED, ActivationQuantizer, batchnorm_parameters, channels_last, fixed_tables, folded_relu,
                  input_source, tables_state)
from .qat_math import qat_math
from .qat_plan import INTEGER_ACTIVATIONS, activation_relu
from .qat_tables import QATTables


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
                "activation": self.activation, "learn": list(self.learn), **tables_state(self.tables)}

    @classmethod
    def from_config(cls, config: dict) -> "QuantizedLayer":
        config = dict(config)
        deserialize = keras.saving.deserialize_keras_object
        layer = deserialize(config.pop("layer"))  # built from its own build config, under its own name
        bn = config.pop("bn")
        bn = None if bn is None else deserialize(bn)
        tables = fixed_tables(config)
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
        gamma, beta, mean, var = batchnorm_parameters(bn)
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
            gamma, beta, mean, var = batchnorm_parameters(self.bn)
            scale = gamma / m.sqrt(var + self.bn.epsilon)
            bias = beta + (bias - mean) * scale
            w = w * self._per_channel(scale)
        source = self.depthwise_quantizer or self.input_quantizer or input_source(self)  # unknown: bias as it is
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
        y = folded_relu(y, self.relu)
        if self.activation is not None:  # on the quantized output: QLinearSigmoid (and QLinearMul) in the int8 model
            y = self.linear_quantizer(y, training=training)
            if self.activation in TABLED:
                return channels_last(self.output_quantizer(TABLED[self.activation](y), training=training), layout)
            s = qat_math().sigmoid(y)
            if self.activation == "sigmoid":
                y = self.output_quantizer(s, training=training)
            else:
                y = self.output_quantizer(y * self.sigmoid_quantizer(s, training=training), training=training)
            return channels_last(y, layout)
        y = channels_last(self.output_quantizer(y, training=training), layout)
        after = self.layer.activation  # one that does not fold (softmax, hard-swish...) runs after, in float
        return y if activation_relu(after) is not None else after(y)
