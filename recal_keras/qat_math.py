"""The ops recal's Keras QAT layers (:mod:`recal_keras.qat`) compute with, per backend.

- TensorFlow: its own fake-quantization ops (:mod:`recal_keras.fake_quant`, shared with the graph API), which tf2onnx
  writes as QuantizeLinear / DequantizeLinear, and ``tf.distribute``'s all-reduce so replicas observe alike.
- JAX and PyTorch: the same grids in ``keras.ops`` while training (a straight-through gradient inside the range,
  as TensorFlow's ops give), and once finalized the backend's own QDQ op with constant scales, which its exporter
  writes as the QuantizeLinear / DequantizeLinear pairs the int8 converter takes: ``torch.fake_quantize_per_*``
  on PyTorch (torch.onnx), the primitive of :mod:`recal_keras.jax_qdq` on JAX (jax2onnx).

Both keep recal_torch's conventions: uint8 activations over a range that holds 0, int8 symmetric weights per output
channel with scale ``max|w| / levels``, biases on the int32 grid of input scale x weight scale.
"""

from __future__ import annotations

import contextlib
import functools

import keras
import numpy as np

from recal_core.modifiers import WEIGHT_LEVELS

from .qat_tables import AVERAGING_CONSTANT
from .tensor_ops import KerasOps, TensorFlowOps


class TensorFlowQATMath:
    """TensorFlow ops, as the graph API computes them."""

    def __init__(self):
        import tensorflow as tf

        from . import fake_quant

        self.tf, self.ops = tf, TensorFlowOps()
        self._activation, self._weight = fake_quant.fake_quant_activation, fake_quant.fake_quant_weight
        self.weight_scale = fake_quant.weight_scale
        self.bias_on_int32_grid = fake_quant.bias_on_int32_grid
        self.moving_range = fake_quant.moving_range
        for name in ("where", "sqrt", "sigmoid", "stop_gradient", "ones_like", "zeros_like", "transpose", "reshape",
                     "pad"):
            setattr(self, name, getattr(tf, name))
        self.relu, self.relu6 = tf.nn.relu, tf.nn.relu6

    def pick(self, pred, a, b):
        return self.tf.where(pred, a, b)

    def constants(self, exporting: bool = True):
        """tf2onnx folds a layer's constant math itself."""
        return contextlib.nullcontext()

    def fake_quant_activation(self, x, low, high, export: bool = False):
        """The same op trains and exports (tf2onnx writes it as a QDQ pair)."""
        return self._activation(x, low, high)

    def fake_quant_weight(self, w, axis: int, levels: int = WEIGHT_LEVELS, export: bool = False, scale=None):
        return self._weight(w, axis, levels, scale)

    def zeros(self, n: int, dtype):
        return self.tf.zeros([n], dtype)

    def moments(self, y):
        """Mean and variance over every axis but the last (the channels)."""
        return self.tf.nn.moments(y, axes=list(range(y.shape.rank - 1)))

    def dense(self, x, w):
        return self.tf.tensordot(x, w, [[x.shape.rank - 1], [0]])

    exports_channels_first = False  # tf2onnx's transpose optimizer lays the convs out for ONNX itself

    def conv(self, x, w, strides=(1, 1), padding="valid", dilation_rate=(1, 1), data_format="channels_last"):
        return self.tf.nn.convolution(x, w, strides=strides, padding=padding.upper(), dilations=dilation_rate)

    def depthwise_conv(self, x, w, strides, padding, dilation_rate, data_format="channels_last"):
        return self.tf.nn.depthwise_conv2d(x, w, strides=(1, *strides, 1), padding=padding.upper(),
                                           dilations=dilation_rate)

    def global_range(self, x):
        """``(min, max)`` of ``x`` over the global batch: every replica gets the same, so observers stay in sync."""
        tf = self.tf
        low, high = tf.reduce_min(x), tf.reduce_max(x)
        replicas = self._replicas()
        if replicas is not None:
            both = replicas.all_gather(tf.stack([low, high])[None], axis=0)  # TF has no MIN/MAX all-reduce
            low, high = tf.reduce_min(both[:, 0]), tf.reduce_max(both[:, 1])
        return low, high

    def global_moments(self, mean, variance):
        """The global batch's mean and variance from each replica's (equal shares): the moving statistics stay in
        sync across replicas, while each replica normalises with its own batch's, as BatchNorm does under DDP."""
        replicas = self._replicas()
        if replicas is None:
            return mean, variance
        tf = self.tf
        mean_all = replicas.all_reduce(tf.distribute.ReduceOp.MEAN, mean)
        square = replicas.all_reduce(tf.distribute.ReduceOp.MEAN, variance + tf.square(mean))
        return mean_all, square - tf.square(mean_all)

    def _replicas(self):
        """The replica context when more than one replica runs this step (a tf.distribute strategy), else None."""
        context = self.tf.distribute.get_replica_context()
        return context if context is not None and context.num_replicas_in_sync > 1 else None


class KerasQATMath:
    """``keras.ops`` on JAX and PyTorch; the backend's QDQ op in a finalized model."""

    def __init__(self):
        from keras import ops

        self.ops, self.k = KerasOps(), ops
        self.backend = keras.backend.backend()
        for name in ("where", "sqrt", "sigmoid", "stop_gradient", "ones_like", "zeros_like", "relu", "relu6",
                     "transpose", "reshape", "pad"):
            setattr(self, name, getattr(ops, name))

    exports_channels_first = True  # see QuantizedLayer._layout

    def pick(self, pred, a, b):
        return self.ops.pick(pred, a, b)

    def constants(self, exporting: bool = True):
        """A finalized layer's math on its variables (folded kernel and bias, qparams), computed as the export's
        constants. On JAX, jax2onnx traces the model with every op staged, constants' too, and its conversion time grows
        with the square of the ops; ``ensure_compile_time_eval`` computes ops on concrete values now. The QDQ ops stay
        outside it: a staged QuantizeLinear / DequantizeLinear is what the converter reads."""
        if exporting and self.backend == "jax":
            import jax

            return jax.ensure_compile_time_eval()
        return contextlib.nullcontext()

    def zeros(self, n: int, dtype):
        return self.k.zeros((n,), dtype)

    def moments(self, y):
        return self.k.moments(y, axes=list(range(len(y.shape) - 1)))

    def dense(self, x, w):
        return self.k.matmul(x, w)

    def conv(self, x, w, strides=(1, 1), padding="valid", dilation_rate=(1, 1), data_format="channels_last"):
        return self.k.conv(x, w, strides=strides, padding=padding, dilation_rate=dilation_rate,
                           data_format=data_format)

    def depthwise_conv(self, x, w, strides, padding, dilation_rate, data_format="channels_last"):
        return self.k.depthwise_conv(x, w, strides=strides, padding=padding, data_format=data_format,
                                     dilation_rate=dilation_rate)

    def global_range(self, x):
        """``(min, max)`` of ``x`` (one process: Keras's JAX and PyTorch trainers run one replica here)."""
        return self.k.min(x), self.k.max(x)

    def global_moments(self, mean, variance):
        return mean, variance

    def moving_range(self, low, high, old_low, old_high, seen):
        """The observer's new ``(min, max)``: the batch's own range the first time, then a moving average."""
        c, where = AVERAGING_CONSTANT, self.k.where
        return where(seen, old_low + c * (low - old_low), low), where(seen, old_high + c * (high - old_high), high)

    def _activation_qparams(self, low, high):
        """Scale and zero point of the uint8 grid over ``[min(low, 0), max(high, low + 1e-6)]``."""
        k = self.k
        low = k.minimum(k.stop_gradient(low), 0.0)
        high = k.maximum(k.stop_gradient(high), low + 1e-6)
        scale = (high - low) / 255.0
        return low, high, scale, k.clip(k.round(-low / scale), 0.0, 255.0)

    def fake_quant_activation(self, x, low, high, export: bool = False):
        """``x`` on the uint8 grid over ``[min(low, 0), max(high, low + 1e-6)]``; gradient 1 inside it, 0 outside;
        with ``export``, the backend's QDQ op (an inference model: no gradient)."""
        k = self.k
        with self.constants(export):
            _, _, scale, zero_point = self._activation_qparams(low, high)
        if export:
            return self._qdq(x, scale, zero_point, None, "uint8")
        q = k.clip(k.round(x / scale) + zero_point, 0.0, 255.0)
        inside = k.logical_and(x >= -zero_point * scale, x <= (255.0 - zero_point) * scale)
        return self._straight_through(x, (q - zero_point) * scale, inside)

    def weight_scale(self, w, axis: int, levels: int = WEIGHT_LEVELS):
        """``max|w| / levels`` per index of ``axis``."""
        k = self.k
        amax = k.max(k.abs(w), axis=[a for a in range(len(w.shape)) if a != axis])
        # a channel pruned to zeros gets scale 1 / levels: a tiny scale would overflow its int32 bias
        return k.where(amax > 0, amax, k.ones_like(amax)) / float(levels)

    def fake_quant_weight(self, w, axis: int, levels: int = WEIGHT_LEVELS, export: bool = False, scale=None):
        """``w`` on the int8 grid, symmetric, one scale ``max|w| / levels`` (or the given, learned, ``scale``, ``w``
        clipped to its ``+-levels`` steps) per index of ``axis`` (with ``export``, the backend's QDQ op)."""
        k = self.k
        shape = [1] * len(w.shape)
        shape[axis] = -1
        with self.constants(export):
            if scale is not None:
                w = k.clip(w, -k.reshape(scale * levels, shape), k.reshape(scale * levels, shape))
            scale = self.weight_scale(k.stop_gradient(w), axis, levels) if scale is None else scale
            zero_point = k.zeros_like(scale)
        if export:
            return self._qdq(w, scale, zero_point, axis, "int8")
        scale = k.reshape(scale, shape)
        return self._straight_through(w, k.round(w / scale) * scale, None)

    def bias_on_int32_grid(self, bias, w, axis: int, low, high, levels: int = WEIGHT_LEVELS, weight_scale=None):
        """``bias`` in whole steps of input scale x weight scale (the int32 an int8 layer holds it as; a learned
        ``weight_scale`` given)."""
        _, _, scale, _ = self._activation_qparams(low, high)
        if weight_scale is None:
            weight_scale = self.weight_scale(self.k.stop_gradient(w), axis, levels)
        step = scale * weight_scale
        return self.k.round(bias / step) * step

    def _straight_through(self, x, quantized, inside):
        """``quantized`` exactly, with the gradient of ``x`` (where ``inside``): the values stay on the grid."""
        k = self.k
        passed = x - k.stop_gradient(x)
        if inside is not None:
            passed = k.where(inside, passed, k.zeros_like(passed))
        return k.stop_gradient(quantized) + passed

    def _qdq(self, x, scale, zero_point, axis: int | None, dtype: str):
        """The backend's QuantizeLinear / DequantizeLinear of ``x``; its exporter writes the qparams as constants."""
        k = self.k
        if self.backend == "jax":
            from .jax_qdq import qdq

            with self.constants():
                zero_point = k.cast(zero_point, dtype)
            return qdq(x, scale, zero_point, axis)
        import torch

        low, high = (0, 255) if dtype == "uint8" else (-128, 127)  # the exporter writes the zero point's type so
        # the qparams become constants of the traced export on purpose (a frozen model's values; export_onnx runs the
        # written file against the Keras model, and keeps torch.jit's TracerWarnings about it out of sight)
        if axis is None:
            return torch.fake_quantize_per_tensor_affine(x, float(scale), int(zero_point), low, high)
        scale = torch.tensor(k.convert_to_numpy(scale).astype(np.float32))
        return torch.fake_quantize_per_channel_affine(x, scale, torch.zeros(scale.shape, dtype=torch.int32), axis,
                                                      low, high)


@functools.cache
def qat_math() -> TensorFlowQATMath | KerasQATMath:
    """This process's QAT ops (the Keras backend is fixed once keras is imported)."""
    return TensorFlowQATMath() if keras.backend.backend() == "tensorflow" else KerasQATMath()
