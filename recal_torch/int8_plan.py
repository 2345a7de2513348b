"""The int8 side of a planned recipe (:mod:`recal_torch.precision_plan` with ``scheme="w8a8"``): a Conv or Linear
layer held in int8, its weights symmetric per output channel and its input uint8 per tensor (the default
``QuantizationModifier`` scheme, what the converter runs as ``QLinearConv`` / ``QGemm``), or left float.

A layer's measured score is the loss of recal's own QAT model with that layer alone quantized, at its start
(:func:`measured_int8`): its input, weights and fused output (after its BatchNorm and ReLU) on their grids. The
cheap estimate (``score="fisher"``) takes the grids QAT starts from (:func:`recal_torch.qat.weight_qparams`,
:func:`~recal_torch.qat.activation_qparams`) for the layer's input and weights, not its output: the weights' scale
from each channel's largest magnitude (a BatchNorm the QAT folds in scales whole channels, which a per-channel
grid follows), the input's from its range over the calibration batches.
"""

from __future__ import annotations

import copy
import math
import warnings

import torch
from torch import nn

from recal_core.precision_plan import ConvGeometry

from .qat import (CONVS, REDUCED_W_LEVELS, W_LEVELS, ActivationFakeQuantize, activation_qparams,
                  fake_quantize_model, fake_quantizers, quantizable_layers, weight_qparams)

PLANNED_CONVS = CONVS[:2]  # 1-D and 2-D convolutions (the timer builds those)


def is_planned_conv(module: nn.Module) -> bool:
    """A 1-D or 2-D convolution recal's QAT quantizes (zero padding)."""
    return isinstance(module, PLANNED_CONVS) and module.padding_mode == "zeros"


def int8_weight(weight: torch.Tensor, reduce_range: bool = False) -> torch.Tensor:
    """``weight`` on its int8 grid (7 bits with ``reduce_range``), per output channel."""
    scale, zero = weight_qparams(weight, REDUCED_W_LEVELS if reduce_range else W_LEVELS)
    levels = int(REDUCED_W_LEVELS if reduce_range else W_LEVELS)
    with torch.no_grad():
        return torch.fake_quantize_per_channel_affine(weight.detach().float(), scale, zero, 0, -levels, levels)


def int8_input(x: torch.Tensor, span: tuple[float, float]) -> torch.Tensor:
    """``x`` on the uint8 grid of the range ``span`` (widened to hold 0)."""
    scale, zero = activation_qparams(torch.tensor(span[0]), torch.tensor(span[1]))
    return torch.fake_quantize_per_tensor_affine(x, float(scale), int(zero), 0, 255)


def input_spans(model: nn.Module, layers: dict[str, nn.Module], batches, loss_fn) -> dict[str, tuple[float, float]]:
    """Each layer's input range (min, max) over ``batches``: the int8 grid its input is scored on."""
    spans: dict[str, tuple[float, float]] = {}

    def keep(name):
        def hook(module, args):
            x = args[0].detach()
            lo, hi = spans.get(name, (math.inf, -math.inf))
            spans[name] = (min(lo, float(x.min())), max(hi, float(x.max())))
        return hook

    hooks = [layer.register_forward_pre_hook(keep(name)) for name, layer in layers.items()]
    try:
        with torch.no_grad():
            for batch in batches:
                loss_fn(model, batch)
    finally:
        for h in hooks:
            h.remove()
    return spans


def measured_int8(model: nn.Module, name: str, batches, loss_fn, reduce_range: bool = False) -> float:
    """The mean loss on ``batches`` of ``model`` with ``name`` alone in int8, as recal's QAT holds it at its start: a
    copy QAT-prepared with every other layer left float (its input, weights and fused output on their grids,
    BatchNorm folded), its observers calibrated on ``batches`` (eval mode otherwise), then frozen."""
    qat = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the planner's notes on the layers left float: all but one, on purpose
        fake_quantize_model(qat, skip=set(quantizable_layers(qat, skip={name})), reduce_range=reduce_range)
    qat.eval()
    observers = [q for q in fake_quantizers(qat) if isinstance(q, ActivationFakeQuantize)]
    with torch.no_grad():
        for q in observers:
            q.train()
        for batch in batches:
            loss_fn(qat, batch)
        for q in observers:
            q.eval()
        return sum(float(loss_fn(qat, b)) for b in batches) / len(batches)


def output_of(layer: nn.Module, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``layer``'s output on ``x`` with ``weight`` in place of its own (the Fisher score's ``dy``)."""
    if isinstance(layer, nn.Linear):
        return nn.functional.linear(x, weight, layer.bias)
    return layer._conv_forward(x, weight, layer.bias)


def geometry(layer: nn.Module, spatial: tuple[int, ...]) -> ConvGeometry:
    """A convolution's geometry at an input of ``spatial`` size (one sample's)."""
    padding = layer.padding
    if padding == "valid":
        padding = (0,) * len(layer.kernel_size)
    elif padding == "same":  # stride 1: half the dilated kernel on each side
        padding = tuple(d * (k - 1) // 2 for k, d in zip(layer.kernel_size, layer.dilation))
    return ConvGeometry(tuple(layer.kernel_size), tuple(layer.stride), tuple(padding), tuple(layer.dilation),
                        layer.groups, tuple(spatial))
