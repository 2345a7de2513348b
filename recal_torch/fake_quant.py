"""Fake quantization: the uint8 / int8 grids QAT trains on, and the observers that choose them.

- Activations: uint8, asymmetric, per tensor, moving-average min/max observers.
- Weights: int8, symmetric (zero point 0, scale ``max|w| / 127``), per output channel; with ``reduce_range``
  7-bit (``|q| <= 64``, scale ``max|w| / 64``): exact in the u8s8 kernels of every x86 CPU
  (:mod:`recal_onnx.cpu`).

The exporter (:mod:`recal_torch.export`) writes these same grids as QuantizeLinear / DequantizeLinear.
"""

from __future__ import annotations

import torch
from torch import nn

from recal_core.modifiers import REDUCED_WEIGHT_LEVELS, WEIGHT_LEVELS

ACT_QMIN, ACT_QMAX = 0, 255
W_QMIN, W_QMAX = -128, 127
W_LEVELS = float(WEIGHT_LEVELS)  # symmetric: |q| <= 127, so -128 is never used
REDUCED_W_LEVELS = float(REDUCED_WEIGHT_LEVELS)  # reduce_range: no x86 u8s8 kernel saturates (recal_core's rule)
EPS = torch.finfo(torch.float32).eps


# --- quantization parameters (shared with the exporter and the tests) ---------------------


def activation_qparams(min_val: torch.Tensor, max_val: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """uint8 asymmetric scale and zero point for a range that is widened to include 0."""
    min_neg = torch.clamp(min_val, max=0.0)
    max_pos = torch.clamp(max_val, min=0.0)
    scale = torch.clamp((max_pos - min_neg) / float(ACT_QMAX - ACT_QMIN), min=EPS)
    zero_point = torch.clamp(ACT_QMIN - torch.round(min_neg / scale), ACT_QMIN, ACT_QMAX).to(torch.int32)
    return scale.to(torch.float32), zero_point


def weight_qparams(weight: torch.Tensor, levels: float = W_LEVELS) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 symmetric per-output-channel (axis 0) scale and zero point (always 0): ``max|w|`` maps to ``levels``
    (127, or 64 under ``reduce_range``)."""
    amax = weight.detach().abs().flatten(1).amax(dim=1)
    scale = torch.clamp(amax / levels, min=EPS).to(torch.float32)
    return scale, torch.zeros_like(scale, dtype=torch.int32)


# --- fake quantizers -----------------------------------------------------------------------


class ActivationFakeQuantize(nn.Module):
    """uint8 per-tensor fake quantization with a moving-average min/max observer.

    Under ``torch.distributed`` the batch min/max are reduced across ranks, so every rank
    holds the same scale.
    """

    def __init__(self, averaging_constant: float = 0.01):
        super().__init__()
        self.averaging_constant = averaging_constant
        self.observer_enabled = True
        self.register_buffer("min_val", torch.tensor(float("inf")))
        self.register_buffer("max_val", torch.tensor(float("-inf")))
        self.register_buffer("scale", torch.tensor(1.0))
        self.register_buffer("zero_point", torch.tensor(0, dtype=torch.int32))
        # False once a hook-made plan (a model torch.fx cannot trace) found this tensor needs no quantizer;
        # a buffer, so the plan travels in checkpoints and the state dict keeps its keys
        self.register_buffer("enabled", torch.tensor(True))

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        state_dict.setdefault(prefix + "enabled", torch.tensor(True))  # checkpoints from before the flag
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    @property
    def active(self) -> bool:
        return bool(self.enabled)

    @torch.no_grad()
    def observe(self, x: torch.Tensor) -> None:
        lo, hi = torch.aminmax(x.detach().float())
        if torch.distributed.is_available() and torch.distributed.is_initialized() \
                and torch.distributed.get_world_size() > 1:
            torch.distributed.all_reduce(lo, op=torch.distributed.ReduceOp.MIN)
            torch.distributed.all_reduce(hi, op=torch.distributed.ReduceOp.MAX)
        if not self.has_observed:
            self.min_val.copy_(lo)
            self.max_val.copy_(hi)
        else:
            c = self.averaging_constant
            self.min_val.add_(c * (lo - self.min_val))
            self.max_val.add_(c * (hi - self.max_val))
        scale, zero_point = activation_qparams(self.min_val, self.max_val)
        self.scale.copy_(scale)
        self.zero_point.copy_(zero_point)

    @property
    def has_observed(self) -> bool:
        return not bool(torch.isinf(self.min_val).item())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.active:
            return x
        if self.training and self.observer_enabled:
            self.observe(x)
        if not self.has_observed:  # just switched on, no range yet: an evaluation now sees float values
            return x
        return torch.fake_quantize_per_tensor_affine(x, self.scale, self.zero_point, ACT_QMIN, ACT_QMAX)

    def extra_repr(self) -> str:
        if not self.active:
            return "off (the plan found this tensor is not held as integers)"
        return f"uint8 per-tensor, observer={'on' if self.observer_enabled else 'frozen'}"


class WeightFakeQuantize(nn.Module):
    """int8 symmetric per-channel fake quantization; the scale follows the weights until frozen.

    ``levels``: the largest integer a weight takes, 127 (8 bits) or 64 (``reduce_range``: 7 bits, exact in every
    x86 u8s8 kernel). The exporter writes the same integers."""

    def __init__(self, channels: int, levels: float = W_LEVELS):
        super().__init__()
        if levels not in (W_LEVELS, REDUCED_W_LEVELS):
            raise ValueError(f"weight levels must be {W_LEVELS:g} or {REDUCED_W_LEVELS:g}, got {levels!r}")
        self.levels = float(levels)
        self.observer_enabled = True
        self.register_buffer("scale", torch.ones(channels))
        self.register_buffer("zero_point", torch.zeros(channels, dtype=torch.int32))

    def qparams(self, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The scale and zero point this quantizer applies to ``weight`` now."""
        if self.observer_enabled:
            with torch.no_grad():
                scale, zero_point = weight_qparams(weight, self.levels)
                self.scale.copy_(scale)
                self.zero_point.copy_(zero_point)
        return self.scale, self.zero_point

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        scale, zero_point = self.qparams(weight)
        # +-levels as export writes it: with a frozen scale a weight that grew past it saturates the same way in both
        return torch.fake_quantize_per_channel_affine(weight, scale, zero_point, 0, -int(self.levels),
                                                      int(self.levels))

    def extra_repr(self) -> str:
        bits = "int8" if self.levels == W_LEVELS else "7-bit (reduce_range)"
        return f"{bits} symmetric per-channel, observer={'on' if self.observer_enabled else 'frozen'}"


class SiLUFakeQuantize(nn.Module):
    """``x * sigmoid(x)`` with the sigmoid and the product each fake-quantized (a SiLU call site's quantizer):
    runtimes then run ``QLinearSigmoid`` and ``QLinearMul`` on the integers, where a SiLU that is one float op
    would leave both in float between two int8 convs. It reads the SiLU's input, not its output. Export swaps its
    two observers for constant QDQ and keeps this forward."""

    reads_input = True  # the call site passes it the SiLU's input (qat_sites)

    def __init__(self):
        super().__init__()
        self.sigmoid = ActivationFakeQuantize()
        self.product = ActivationFakeQuantize()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.product(x * self.sigmoid(torch.sigmoid(x)))


