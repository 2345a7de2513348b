"""The fake-quantization math both TensorFlow front ends use, with recal_torch's conventions.

- Activations: uint8, asymmetric, per tensor (``FakeQuantWithMinMaxVars``, which tf2onnx exports as
  QuantizeLinear/DequantizeLinear with a zero point); the range always holds 0, so the zero point is exact.
- Weights: int8, symmetric (``max|w| / 127``; ``max|w| / 64`` with the QuantizationModifier's ``reduce_range``),
  per output channel (``QuantizeAndDequantizeV3`` with ``axis``,
  which tf2onnx exports as per-channel QuantizeLinear/DequantizeLinear; the per-channel FakeQuant op has no
  tf2onnx converter, and ``quantize_and_dequantize_v2`` refuses per-channel given ranges on TF 2.21).
"""

from __future__ import annotations

import tensorflow as tf

from recal_core.modifiers import WEIGHT_LEVELS

from .qat_tables import AVERAGING_CONSTANT


def _activation_range(low, high):
    low = tf.minimum(tf.stop_gradient(low), 0.0)
    return low, tf.maximum(tf.stop_gradient(high), low + 1e-6)


def fake_quant_activation(x, low, high):
    """``x`` fake-quantized to uint8 over ``[min(low, 0), max(high, low + 1e-6)]`` (no gradient to the range)."""
    low, high = _activation_range(low, high)
    return tf.quantization.fake_quant_with_min_max_vars(x, low, high, num_bits=8, narrow_range=False)




def _weight_range(w, axis: int):
    axes = [a for a in range(len(w.shape)) if a != axis]
    amax = tf.reduce_max(tf.abs(w), axis=axes)
    # a channel pruned to zeros gets scale 1/127 (its integers are 0 whatever the scale): a tiny scale would
    # overflow its int32 bias (bias / (x_scale * w_scale)) in the converted model
    return tf.where(amax > 0, amax, tf.ones_like(amax))


def weight_scale(w, axis: int, levels: int = WEIGHT_LEVELS):
    """The per-channel scale :func:`fake_quant_weight` gives ``w``: ``max|w| / levels``."""
    return _weight_range(w, axis) / levels


def fake_quant_weight(w, axis: int, levels: int = WEIGHT_LEVELS, scale=None):
    """``w`` fake-quantized to int8, symmetric, one scale per index of ``axis`` (its output channels): ``max|w|``
    maps to ``levels`` (127; 64 with ``reduce_range``), or the given (learned) ``scale``, ``w`` clipped to its
    ``+-levels`` steps first.

    The op quantizes ``[-r, r]`` to +-127; ``r = scale * 127`` gives that scale, so the integers stay within
    +-levels and tf2onnx writes that scale."""
    if scale is not None:
        shape = [1] * len(w.shape)
        shape[axis] = -1
        bound = tf.reshape(scale * levels, shape)
        w = tf.clip_by_value(w, -bound, bound)
    amax = (weight_scale(w, axis, levels) if scale is None else scale) * WEIGHT_LEVELS
    return tf.raw_ops.QuantizeAndDequantizeV3(input=w, input_min=-amax, input_max=amax, num_bits=8,
                                              signed_input=True, range_given=True, narrow_range=True, axis=axis)


def bias_on_int32_grid(bias, w, axis: int, low, high, levels: int = WEIGHT_LEVELS, weight_scale=None):
    """``bias`` rounded to whole steps of input scale x weight scale, the int32 an int8 layer holds it as (as
    ``recal_torch.export.bias_grid`` writes it: an off-grid bias flips output values near a rounding boundary in the
    converted model). The scales are those :func:`fake_quant_activation` over ``[low, high]`` (its nudging moves
    the range, not the scale) and :func:`fake_quant_weight` of ``w`` quantize with (``weight_scale``: a learned
    one); beyond int32, the converter
    keeps the layer float and says why."""
    low, high = _activation_range(low, high)
    step = (high - low) / 255.0 * (_weight_range(w, axis) / levels if weight_scale is None else weight_scale)
    return tf.round(bias / step) * step


def moving_range(low, high, old_low, old_high, seen):
    """The observer's new ``(min, max)``: the batch's own range the first time, then a moving average."""
    c = AVERAGING_CONSTANT
    return (tf.where(seen, old_low + c * (low - old_low), low),
            tf.where(seen, old_high + c * (high - old_high), high))
