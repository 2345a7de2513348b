"""Fake quantization: the uint8 / int8 grids QAT trains on, and the observers that choose them.

- Activations: uint8, asymmetric, per tensor, moving-average min/max observers.
- Weights: int8, symmetric (zero point 0, scale ``max|w| / 127``), per output channel; with ``reduce_range``
  7-bit (``|q| <= 64``, scale ``max|w| / 64``): exact in the u8s8 kernels of every x86 CPU
  (:mod:`recal_onnx.cpu`).

- Weight-only layers (W4A16, W8A16): int4 (``|q| <= 7``), ternary int2 (``|q| <= 1``) or int8 symmetric weights,
  per output channel or per group of ``group_size`` inputs (:class:`GroupWeightFakeQuantize`), activations float.

The exporter (:mod:`recal_torch.export`) writes these same grids as QuantizeLinear / DequantizeLinear.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from recal_core.modifiers import REDUCED_WEIGHT_LEVELS, WEIGHT_LEVELS, WEIGHT_ONLY_LEVELS

from .fake_quant import fake_quantize, per_channel

ACT_QMIN, ACT_QMAX = 0, 255
W_QMIN, W_QMAX = -128, 127
W_LEVELS = float(WEIGHT_LEVELS)  # symmetric: |q| <= 127, so -128 is never used
REDUCED_W_LEVELS = float(REDUCED_WEIGHT_LEVELS)  # reduce_range: no x86 u8s8 kernel saturates (recal_core's rule)
EPS = torch.finfo(torch.float32).eps
# a weight channel's scale is at least its layer's largest over this: a channel thousands of times quieter than its
# neighbours (a filter trained nearly dead, common in pretrained nets) keeps a grid on which its bias still fits the
# int32 steps (input scale x weight scale) an integer kernel adds it in; at eps it would overflow them, and the
# converter would have to leave the layer float
CHANNEL_SPAN = 2.0 ** 12


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
    scale = torch.clamp(amax / levels, min=EPS)
    scale = torch.maximum(scale, scale.max() / CHANNEL_SPAN).to(torch.float32)
    return scale, torch.zeros_like(scale, dtype=torch.int32)


# --- fake quantizers -----------------------------------------------------------------------


class LearnableScale:
    """What a quantizer whose scale may be learned (LSQ) shares: ``learned`` says so; the scale, then a parameter,
    trains while the observer would observe (``observer_enabled``) and stops when frozen."""

    learned = False

    @property
    def observer_enabled(self) -> bool:
        return self._observer_enabled

    @observer_enabled.setter
    def observer_enabled(self, enabled: bool) -> None:
        self._observer_enabled = bool(enabled)
        if self.learned:
            self.scale.requires_grad_(self._observer_enabled)

    def _scale_to_parameter(self, started: bool = True) -> nn.Parameter:
        """The ``scale`` buffer made a parameter (same name in the state dict); with ``started``, a ``started``
        buffer too, set once :meth:`_learned_scale` has taken the start (a checkpoint carries that it did)."""
        scale = self._buffers.pop("scale")
        self.scale = nn.Parameter(scale.detach().clone())
        self.learned = True
        if started:
            self.register_buffer("started", torch.tensor(False))
            self._started = False
        self.observer_enabled = self.observer_enabled
        return self.scale

    def _learned_scale(self, start) -> torch.Tensor:
        """The learned scale: ``start()`` (the weights' fit) the first time, kept positive (a step may take it
        through zero)."""
        with torch.no_grad():
            if not self._started:
                self.scale.copy_(start())
                self.started.fill_(True)
                self._started = True
            self.scale.clamp_(min=EPS)
        return self.scale

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        if "started" in self._buffers:
            self._started = bool(self.started)


class ActivationFakeQuantize(LearnableScale, nn.Module):
    """uint8 per-tensor fake quantization with a moving-average min/max observer.

    Under ``torch.distributed`` the batch min/max are reduced across ranks, so every rank
    holds the same scale. Whether it is on and whether it has observed are kept as Python flags beside their buffers
    (set with them, read back from a loaded state dict), so ``forward`` branches on no tensor: ``torch.export`` and
    ``torch.fx`` trace a QAT model in any phase.
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
        self._active, self._observed = True, False  # the two buffers' values, as Python flags

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        state_dict.setdefault(prefix + "enabled", torch.tensor(True))  # checkpoints from before the flag
        if "calibrated" in self._buffers and prefix + "calibrated" not in state_dict:  # ... before calibration
            started = prefix + "min_val" in state_dict and not bool(torch.isinf(state_dict[prefix + "min_val"]))
            state_dict[prefix + "calibrated"] = torch.tensor(self.calibration_steps if started else 0)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        self._active, self._observed = bool(self.enabled), not bool(torch.isinf(self.min_val).item())
        if "calibrated" in self._buffers:
            self._calibrated = int(self.calibrated)

    @property
    def active(self) -> bool:
        return self._active

    def set_active(self, active: bool) -> None:
        """Switch this quantizer on or off (a plan found its tensor is, or is not, held as integers)."""
        self.enabled.fill_(active)
        self._active = bool(active)

    @torch.no_grad()
    def observe(self, x: torch.Tensor, average: float | None = None) -> None:
        """Move the range towards ``x``'s (by ``averaging_constant``, or ``average``) and set the scale and zero
        point from it (a learned scale only while ``average`` is given: its start)."""
        lo, hi = (v.float() for v in torch.aminmax(x.detach()))  # in x's dtype: no float32 copy of x
        if torch.distributed.is_available() and torch.distributed.is_initialized() \
                and torch.distributed.get_world_size() > 1:
            torch.distributed.all_reduce(lo, op=torch.distributed.ReduceOp.MIN)
            torch.distributed.all_reduce(hi, op=torch.distributed.ReduceOp.MAX)
        if not self.has_observed:
            self.min_val.copy_(lo)
            self.max_val.copy_(hi)
        else:
            c = self.averaging_constant if average is None else average
            self.min_val.add_(c * (lo - self.min_val))
            self.max_val.add_(c * (hi - self.max_val))
        scale, zero_point = activation_qparams(self.min_val, self.max_val)
        if not self.learned or average is not None:  # a learned scale takes the range as its start only
            self.scale.copy_(scale)
            self.zero_point.copy_(zero_point)
        self._observed = True

    @property
    def has_observed(self) -> bool:
        return self._observed

    def learn(self, calibration_steps: int = 1) -> nn.Parameter:
        """Make the scale learned (LSQ): a parameter, started from the range of the first ``calibration_steps``
        training batches (their minima and maxima averaged), then trained with LSQ's gradient scale
        ``1 / sqrt(values a sample * 255)``; the zero point stays where that range put it."""
        self.calibration_steps = calibration_steps
        self.register_buffer("calibrated", torch.tensor(0))  # batches the start has seen (a checkpoint keeps it)
        self._calibrated = 0
        return self._scale_to_parameter(started=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.active:
            return x
        if self.learned:
            return self._learned(x)
        if self.training and self.observer_enabled:
            self.observe(x)
        if not self.has_observed:  # just switched on, no range yet: an evaluation now sees float values
            return x
        return torch.fake_quantize_per_tensor_affine(x, self.scale, self.zero_point, ACT_QMIN, ACT_QMAX)

    def _learned(self, x: torch.Tensor) -> torch.Tensor:
        calibrating = self.training and self.observer_enabled and self._calibrated < self.calibration_steps
        if not self.has_observed and not calibrating:
            return x
        if calibrating:  # the start: the batches' ranges averaged, the scale and zero point set from them
            with torch.no_grad():
                self._calibrated += 1
                self.calibrated.fill_(self._calibrated)
                self.observe(x, average=1.0 / self._calibrated)
        with torch.no_grad():
            self.scale.clamp_(min=EPS)
        per_sample = max(x[0].numel() if x.dim() else 1, 1)
        return fake_quantize(x, self.scale, self.zero_point, ACT_QMIN, ACT_QMAX, 1.0 / math.sqrt(per_sample * ACT_QMAX))

    def extra_repr(self) -> str:
        if not self.active:
            return "off (the plan found this tensor is not held as integers)"
        return f"uint8 per-tensor, observer={'on' if self.observer_enabled else 'frozen'}"


class WeightFakeQuantize(LearnableScale, nn.Module):
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

    def learn(self) -> nn.Parameter:
        """Make the scale learned (LSQ): a parameter, started from the weights' minmax at the next forward, then
        trained with LSQ's gradient scale ``1 / sqrt(weights a channel * levels)``."""
        return self._scale_to_parameter()

    def qparams(self, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The scale and zero point this quantizer applies to ``weight`` now."""
        if self.learned:
            self._learned_scale(lambda: weight_qparams(weight, self.levels)[0])
        elif self.observer_enabled:
            with torch.no_grad():
                scale, zero_point = weight_qparams(weight, self.levels)
                self.scale.copy_(scale)
                self.zero_point.copy_(zero_point)
        return self.scale, self.zero_point

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        scale, _ = self.qparams(weight)  # symmetric: zero point 0
        grad_scale = 1.0 / math.sqrt(weight[0].numel() * self.levels)  # LSQ's, for a learned scale
        # +-levels as export writes it: with a frozen scale a weight that grew past it saturates the same way in both
        return fake_quantize(weight, per_channel(scale, weight), 0.0, -int(self.levels), int(self.levels), grad_scale)

    def extra_repr(self) -> str:
        bits = "int8" if self.levels == W_LEVELS else "7-bit (reduce_range)"
        return f"{bits} symmetric per-channel, observer={'on' if self.observer_enabled else 'frozen'}"


MSE_CLIPS = torch.linspace(1.0, 0.5, 11).tolist()  # the fractions of max|w| the mse observer tries per group
# ternary weights: a Gaussian group's best threshold is near a third of its largest magnitude, so the search goes lower
TERNARY_MSE_CLIPS = torch.linspace(1.0, 0.1, 19).tolist()


class GroupWeightFakeQuantize(LearnableScale, nn.Module):
    """Symmetric fake quantization of a ``[out, in]`` weight to ``bits`` (2: ``|q| <= 1``; 4: ``|q| <= 7``; 8:
    ``|q| <= 127``), one scale per ``group_size`` consecutive inputs of an output channel (``None``: per channel): the
    grid of a weight-only layer, which onnxruntime's ``MatMulNBits`` runs with block size = group size.

    ``observer``: ``"minmax"`` maps each group's largest magnitude to the top level; ``"mse"`` tries clipping it
    (:data:`MSE_CLIPS`; for 2 bits :data:`TERNARY_MSE_CLIPS`) and keeps, per group, the scale with the least squared
    error. The scale follows the weights until frozen, as :class:`WeightFakeQuantize`'s does. ``"lsq"`` learns it:
    the mse scale at the first forward (a calibrated start), then a parameter the optimizer trains (the manager gives
    it a param group of its own), with LSQ's gradient scale ``1 / sqrt(group_size * levels)``; frozen, it stops
    training."""

    def __init__(self, out_features: int, in_features: int, bits: int, group_size: int | None,
                 observer: str = "minmax"):
        super().__init__()
        group = group_size or in_features
        if in_features % group:
            raise ValueError(f"{in_features} inputs do not split into groups of {group}")
        if bits not in WEIGHT_ONLY_LEVELS or observer not in ("minmax", "mse", "lsq"):
            raise ValueError(f"bits must be 2, 4 or 8 and observer minmax, mse or lsq, got {bits!r} and {observer!r}")
        self.bits, self.group_size, self.per_channel, self.observer = bits, group, group_size is None, observer
        self.levels = float(WEIGHT_ONLY_LEVELS[bits])
        self.register_buffer("scale", torch.ones(out_features, in_features // group))
        self.observer_enabled = True
        if observer == "lsq":  # learned, from the mse fit
            self._scale_to_parameter()

    def _fake(self, rows: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return fake_quantize(rows, scale.reshape(-1, 1), 0.0, -int(self.levels), int(self.levels))

    @torch.no_grad()
    def _observe(self, rows: torch.Tensor) -> torch.Tensor:
        amax = rows.abs().amax(dim=1)
        best = torch.clamp(amax / self.levels, min=EPS)
        if self.observer in ("mse", "lsq"):
            error = ((self._fake(rows, best) - rows) ** 2).sum(dim=1)
            for clip in (TERNARY_MSE_CLIPS if self.bits == 2 else MSE_CLIPS)[1:]:
                scale = torch.clamp(amax * clip / self.levels, min=EPS)
                candidate = ((self._fake(rows, scale) - rows) ** 2).sum(dim=1)
                better = candidate < error
                best, error = torch.where(better, scale, best), torch.where(better, candidate, error)
        return best

    def qparams(self, weight: torch.Tensor) -> torch.Tensor:
        """The ``[out, in / group_size]`` scales this quantizer applies to ``weight`` now.

        Args:
            weight: the ``[out, in]`` weight (observed, unless frozen)."""
        def fit() -> torch.Tensor:
            return self._observe(weight.detach().float().reshape(-1, self.group_size)).reshape(self.scale.shape)

        if self.learned:  # LSQ's start: the mse scales of the weights as they are at the first forward
            return self._learned_scale(fit)
        if self.observer_enabled:
            self.scale.copy_(fit())
        return self.scale

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        """``weight`` on its grid, the gradient passed straight through (and, learned, to the scale, LSQ's way).

        Args:
            weight: the ``[out, in]`` weight."""
        scale = self.qparams(weight)
        rows = weight.reshape(-1, self.group_size)
        grad_scale = 1.0 / math.sqrt(self.group_size * self.levels)  # LSQ's, for a learned scale
        return fake_quantize(rows, scale.reshape(-1, 1), 0.0, -int(self.levels), int(self.levels),
                             grad_scale).reshape(weight.shape)

    def integers(self, weight: torch.Tensor) -> torch.Tensor:
        """``weight``'s integers on this grid, ``[out, in]`` int8 (what the export writes).

        Args:
            weight: the ``[out, in]`` weight."""
        with torch.no_grad():
            rows = weight.detach().reshape(-1, self.group_size) / self.qparams(weight).detach().reshape(-1, 1)
            return torch.clamp(torch.round(rows), -self.levels, self.levels).reshape(weight.shape).to(torch.int8)

    def describe(self) -> str:
        """The grid in words, e.g. ``int4 symmetric per group of 32 (mse)``."""
        grouping = "per channel" if self.per_channel else f"per group of {self.group_size}"
        return f"int{self.bits} symmetric {grouping} ({self.observer})"

    def extra_repr(self) -> str:
        return f"{self.describe()}, observer={'on' if self.observer_enabled else 'frozen'}"


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


