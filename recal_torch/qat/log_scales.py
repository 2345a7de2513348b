"""Learned quantization scales under the user's optimizer: stepped in log space by optimizers whose step ignores the
gradient's size (Adam and its kin), and on the raw scale, watched for the floor, by SGD and the rest.

Adam, AdamW, Adagrad, RMSprop, Lion and their kin move each parameter by about the learning rate per step whatever
its size: at an ordinary 1e-3 a weight scale of 1e-3 crosses zero within a step, and only a floor at float32's eps
kept it positive, saturating what it quantizes (217 weight groups of a 5M-parameter decoder in 300 steps of AdamW).
Under those optimizers recal makes each step of a learned scale ``s`` exactly the optimizer's step on ``log s``:
before it, the gradient becomes ``d loss / d log s = s * d loss / d s``; after it, the step ``d`` the optimizer took
becomes ``s * exp(d)``, so a step changes a scale by about ``lr`` of itself and never reaches zero (as Keras's
learned scales, ``start * exp(log_ratio)``). The parameter still holds the scale (state dicts, exports, checkpoints
unchanged); the optimizer's moments are in log units.

SGD (and any optimizer not known to normalize its step) keeps LSQ's own update on the raw scale, whose step is the
gradient's size: there, log space would shrink a small scale's steps by its square. A scale such a step takes
through zero is held at eps, and :class:`LogScaleSteps` says so at the first step it happens (on an accelerator,
within ``CHECK_EVERY`` steps: looking waits on the device), naming the layers.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from .quantizers import EPS

CHECK_EVERY = 50  # raw steps between floor checks on an accelerator (each waits on the device)
# optimizer class names (lower case) whose step is normalized by the gradient's running size or sign
_NORMALIZED = ("adam", "ada", "rmsprop", "lamb", "lion", "sophia")


def steps_in_log_space(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` moves a parameter by about its learning rate whatever the gradient's size (Adam and
    its kin, by class name: torch's, bitsandbytes', apex's), so that learned scales must step in log space."""
    return any(key in type(optimizer).__name__.lower() for key in _NORMALIZED)


class LogScaleSteps:
    """The learned scales of one training run: :meth:`before_step` once their gradients are final,
    :meth:`after_step` once the optimizer stepped. ``on_floor(scales)`` is called at the first step that leaves
    some at float32's eps (raw steps only)."""

    def __init__(self, log_space: bool, on_floor: Callable[[list[nn.Parameter]], None] | None = None) -> None:
        self.log_space = log_space
        self.scales: list[nn.Parameter] = []
        self._on_floor = on_floor
        self._floor_said = False
        self._steps = 0  # raw steps taken, to space the floor check on an accelerator
        self._before: list[torch.Tensor] | None = None  # each scale with a gradient, before this step (log space)
        self._stepped: list[nn.Parameter] = []

    def add(self, scales: list[nn.Parameter]) -> None:
        """Step these too (a scale already here, given again when a checkpoint re-creates its layer, once)."""
        known = {id(s) for s in self.scales}
        self.scales.extend(s for s in scales if id(s) not in known)

    @torch.no_grad()
    def before_step(self) -> None:
        """In log space: each gradient times its scale, and the scales kept to read the optimizer's step. A closure
        evaluated again within the step (LBFGS's line search) has its new gradients scaled by the scales as they are
        then, the step still read from its start."""
        if not self.log_space:
            return
        stepped = [s for s in self.scales if s.grad is not None]
        if not stepped:
            return
        torch._foreach_clamp_min_(stepped, EPS)  # one loaded or set by hand at or below zero
        now = [s.detach().clone() for s in stepped]
        if self._before is None:
            self._stepped, self._before = stepped, now
        torch._foreach_mul_([s.grad for s in stepped], now)

    @torch.no_grad()
    def after_step(self) -> None:
        """In log space, the optimizer's step ``d`` on each scale taken as a step of its log: ``s * exp(d)``; on
        raw scales, those a step took through zero held at eps (said at the first step one is)."""
        if self._before is not None:
            steps = torch._foreach_sub(self._stepped, self._before)
            torch._foreach_exp_(steps)
            torch._foreach_mul_(steps, self._before)
            torch._foreach_copy_(self._stepped, steps)
            self._before, self._stepped = None, []
        self.floor()
        if self.log_space or self._floor_said or self._on_floor is None or not self.scales:
            return
        self._steps += 1
        # looking waits on the device: every step on the CPU, every CHECK_EVERY steps on an accelerator
        if self.scales[0].device.type == "cpu" or self._steps % CHECK_EVERY == 0:
            floored = self.floored()
            if floored:
                self._floor_said = True
                self._on_floor(floored)

    @torch.no_grad()
    def floor(self) -> None:
        """Scales at float32's eps at least (one loaded or set by hand below it too)."""
        if self.scales:
            torch._foreach_clamp_min_(self.scales, EPS)

    def floored(self) -> list[nn.Parameter]:
        """The scales with a value at the floor (one device sync for all)."""
        if not self.scales:
            return []
        lowest = torch.stack([s.detach().min() for s in self.scales])
        return [s for s, low in zip(self.scales, lowest.tolist()) if low <= EPS]
