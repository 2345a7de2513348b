"""Learned quantization scales (LSQ, ``observer: lsq``) as both TensorFlow front ends train them, written once over
the tensor-op adapters of :mod:`recal_keras.tensor_ops` (Keras on every backend: :mod:`recal_keras.learned_scales`;
the graph API: :mod:`recal_tf.graph.qat`).

A scale learns as ``start * exp(log_ratio)``. ``start`` is taken at the first QAT step (a kernel's ``max|w| /
levels`` per channel; an input's range, its zero point kept) and ``log_ratio`` is the one trainable variable, 0 at
first. In log space because these optimizers take one learning rate for every variable (recal_torch gives its scales
a param group and an ``lr_factor``): Adam moves a variable by about its learning rate a step whatever its size,
which would take a scale of 0.002 past zero within dozens of steps at a weight's rate; a step moves ``log_ratio`` by
a relative amount and the scale stays positive. While the observers run the scale trains and the front end records
it (a kernel's ``current``; an input's ``min`` / ``max``); after, and in evaluation and export, it quantizes with what
was recorded, so momentum still moving ``log_ratio`` then changes nothing. Each step function returns the scale to
quantize with and the variables' new values, which the front end assigns its way.
"""

from __future__ import annotations

import math

TINY = 1e-8  # a scale never reaches 0 (the grid's division), whatever a step does to it
LOG_RATIO = "log_ratio"  # the name of every learned scale's trainable variable


def lsq(ops, x, scale, zero_point, qmin: float, qmax: float, grad_factor: float):
    """``x`` on the grid ``(clip(round(x / scale) + zero_point, qmin, qmax) - zero_point) * scale``: the gradient
    passes to ``x`` inside the grid and to ``scale`` as LSQ's (``round(v) - v`` inside, the grid's ends outside),
    times ``grad_factor``; the value is exactly the grid's (recal_torch's ``fake_quantize``, written with
    ``stop_gradient``)."""
    scale = scale * grad_factor + ops.stop_gradient(scale - scale * grad_factor)  # value: scale; gradient: scaled
    v = ops.clip(x / scale + zero_point, qmin, qmax)
    q = v + ops.stop_gradient(ops.round(v) - v)
    return (q - zero_point) * scale


def _learned(ops, begin, log_ratio):
    """``begin * exp(log_ratio)``, never below :data:`TINY`. ``begin`` goes into the product through a new tensor:
    it may be the start variable itself, which a front end running op by op (Keras on PyTorch) overwrites in place
    with this step's new value before the backward pass needs it."""
    return ops.maximum(ops.maximum(begin, TINY) * ops.exp(log_ratio), TINY)


def kernel_step(ops, observing, start_now, start, started, current, log_ratio):
    """A kernel's per-channel scales at one training step: ``(scale, new values of start, started, current)``.
    ``start_now``: ``max|w| / levels``, the start at the first QAT step (``started`` still 0)."""
    first = ops.logical_and(observing, started <= 0)
    begin = ops.pick(first, start_now, start)
    learned = _learned(ops, begin, log_ratio)
    recorded = ops.maximum(current, TINY) + 0.0 * log_ratio  # (in the graph either way: an optimizer warns of a
    scale = ops.pick(observing, learned, recorded)  # variable without a gradient otherwise)
    return scale, {"start": begin, "started": ops.pick(observing, ops.ones_like(started), started),
                   "current": ops.pick(observing, ops.stop_gradient(learned), current)}


def per_channel(ops, w, scale, axis: int, levels: int):
    """``w`` on its per-channel int8 grid (``|q| <= levels``), LSQ's gradient scale ``1 / sqrt(values * levels)``."""
    shape = [1] * len(w.shape)
    shape[axis] = -1
    values = math.prod(int(d) for d in w.shape) // int(w.shape[axis])
    return lsq(ops, w, ops.reshape(scale, shape), 0.0, -float(levels), float(levels), 1.0 / math.sqrt(values * levels))


def input_step(ops, first, low, high, start, zero_point, log_ratio):
    """A layer input's scale at one training step: ``(scale, zero point, new values of start, zero_point, min,
    max)``; at the ``first`` QAT step the range ``[low, high]`` gives the start. ``min`` / ``max`` are the learned
    grid's, which evaluation, export and the frozen observer read."""
    low = ops.minimum(low, 0.0)
    start_now = (ops.maximum(high, low + 1e-6) - low) / 255.0
    begin = ops.pick(first, start_now, start)
    zero = ops.pick(first, ops.clip(ops.round(-low / start_now), 0.0, 255.0), zero_point)
    scale = _learned(ops, begin, log_ratio)
    held = ops.stop_gradient(scale)
    return scale, zero, {"start": begin, "zero_point": zero, "min": -zero * held, "max": (255.0 - zero) * held}


def per_tensor(ops, x, scale, zero_point):
    """``x`` on its uint8 grid, LSQ's gradient scale ``1 / sqrt(values a sample * 255)``."""
    values = math.prod(int(d) for d in x.shape[1:] if d is not None) or 1
    return lsq(ops, x, scale, zero_point, 0.0, 255.0, 1.0 / math.sqrt(values * 255.0))
