"""Schedule factories: check arguments once, return a pure function ``step -> value``.

The step convention (shared by every backend): after ``k`` optimizer steps, the
value in force is ``schedule(k)``. Epochs become steps with :func:`epoch_to_step`
(round half up), once, when a recipe is bound to ``steps_per_epoch``.
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

Schedule = Callable[[int], float]

INTERPOLATION_EXPONENTS = {"linear": 1.0, "cubic": 3.0, "inverse_cubic": 1.0 / 3.0}


def epoch_to_step(epoch: float, steps_per_epoch: int) -> int:
    """The step at which ``epoch`` begins: ``floor(epoch * steps_per_epoch + 0.5)``.

    >>> epoch_to_step(2.5, 3)
    8
    """
    if steps_per_epoch <= 0:
        raise ValueError(f"steps_per_epoch must be > 0, got {steps_per_epoch}")
    return int(math.floor(epoch * steps_per_epoch + 0.5 + 1e-9))


def interpolate(progress: float, init: float, final: float, inter_func: str) -> float:
    """``init + (final - init) * (1 - (1 - p)^e)``, p clipped to [0, 1]; e = 1, 3, 1/3."""
    if inter_func not in INTERPOLATION_EXPONENTS:
        raise ValueError(f"inter_func must be one of {sorted(INTERPOLATION_EXPONENTS)}, got {inter_func!r}")
    p = min(max(progress, 0.0), 1.0)
    value = init + (final - init) * (1.0 - (1.0 - p) ** INTERPOLATION_EXPONENTS[inter_func])
    return min(max(value, min(init, final)), max(init, final))


def update_steps(start_step: int, end_step: int, every: int) -> Callable[[int], bool]:
    """Whether a mask update happens at step ``k``: at start, every ``every`` steps, and at end."""
    if every < 1:
        raise ValueError(f"update interval must be >= 1 step, got {every}")

    def is_update(k: int) -> bool:
        return start_step <= k <= end_step and ((k - start_step) % every == 0 or k == end_step)

    return is_update


def gradual_sparsity(init: float, final: float, start_step: int, end_step: int, every: int,
                     inter_func: str = "cubic", leave_enabled: bool = True) -> Callable[[int], float | None]:
    """Target sparsity in force after ``k`` steps, or ``None`` when no mask is in force.

    Before ``start_step``: None. From ``start_step``, the value of the last update step
    ``u <= k`` with progress ``(u - start) / (end - start)``. At ``end_step``: ``final``,
    held afterwards when ``leave_enabled``, else None after ``end_step``.

    >>> s = gradual_sparsity(0.0, 0.8, 0, 10, 5, "linear")
    >>> [s(k) for k in (0, 4, 5, 9, 10, 11)]
    [0.0, 0.0, 0.4, 0.4, 0.8, 0.8]
    """
    if not (0.0 <= init <= final < 1.0):
        raise ValueError(f"need 0 <= init ({init}) <= final ({final}) < 1")
    if start_step < 0 or every < 1:
        raise ValueError(f"need start_step >= 0 and every >= 1, got {start_step}, {every}")
    end_step = max(end_step, start_step)
    span = end_step - start_step

    def sparsity(k: int) -> float | None:
        if k < start_step:
            return None
        if k >= end_step:
            return final if (k == end_step or leave_enabled) else None
        u = start_step + ((k - start_step) // every) * every
        return interpolate((u - start_step) / span, init, final, inter_func)

    return sparsity


def acdc_phases(sparsity: float, start_step: int, end_step: int, phase_steps: int,
                leave_enabled: bool = True) -> tuple[Callable[[int], float | None], Callable[[int], bool]]:
    """AC/DC (Peste et al., 2021): phases of ``phase_steps`` alternate between compressed (a magnitude mask
    at ``sparsity``, computed at the phase's first step and held) and decompressed (no mask), counted back
    from ``end_step`` so that the last phase is compressed; after it the mask holds with ``leave_enabled``.
    Returns ``(sparsity(k) or None, is_update(k))``.

    >>> s, u = acdc_phases(0.9, 0, 8, 2)
    >>> [s(k) for k in range(10)], [k for k in range(10) if u(k)]
    ([None, None, 0.9, 0.9, None, None, 0.9, 0.9, 0.9, 0.9], [2, 6])
    """
    if not 0 <= sparsity < 1 or phase_steps < 1 or end_step <= start_step:
        raise ValueError(f"need 0 <= sparsity < 1, phase_steps >= 1, end > start; got {sparsity}, {phase_steps}, "
                         f"{start_step}, {end_step}")

    def compressed(k: int) -> bool:
        return ((end_step - 1 - k) // phase_steps) % 2 == 0

    def value(k: int) -> float | None:
        if k < start_step:
            return None
        if k >= end_step:
            return sparsity if leave_enabled else None
        return sparsity if compressed(k) else None

    def is_update(k: int) -> bool:
        return start_step <= k < end_step and compressed(k) and (k == start_step or not compressed(k - 1))

    return value, is_update


def constant(value: float) -> Schedule:
    """A schedule that is ``value`` at every step."""
    return lambda k: value


def exponential_lr(init_lr: float, gamma: float, start_step: int, steps_per_epoch: int) -> Schedule:
    """``init_lr * gamma ** completed_epochs`` (epochs counted from ``start_step``)."""
    _check_lr(init_lr, gamma)
    return lambda k: init_lr * gamma ** max(0, (k - start_step) // steps_per_epoch)


def step_lr(init_lr: float, gamma: float, start_step: int, step_size_steps: int) -> Schedule:
    """``init_lr * gamma ** (completed step periods)``; a period is ``step_size_steps`` steps."""
    _check_lr(init_lr, gamma)
    if step_size_steps < 1:
        raise ValueError(f"step size must be >= 1 step, got {step_size_steps}")
    return lambda k: init_lr * gamma ** max(0, (k - start_step) // step_size_steps)


def multistep_lr(init_lr: float, gamma: float, milestone_steps: Sequence[int]) -> Schedule:
    """``init_lr * gamma ** (number of milestones reached)``; a milestone at step m applies from m."""
    _check_lr(init_lr, gamma)
    milestones = sorted(milestone_steps)
    return lambda k: init_lr * gamma ** sum(1 for m in milestones if m <= k)


def cosine_warm_restarts_lr(init_lr: float, eta_min: float, start_step: int, cycle_steps: int,
                           t_mult: int = 1) -> Schedule:
    """SGDR (torch's ``CosineAnnealingWarmRestarts``), per step: within a cycle of ``T_i`` steps the LR
    falls from ``init_lr`` to ``eta_min`` along half a cosine, then restarts; cycles grow ``t_mult``-fold.

    >>> s = cosine_warm_restarts_lr(1.0, 0.0, 0, 4)
    >>> [round(s(k), 3) for k in (0, 2, 4, 6)]
    [1.0, 0.5, 1.0, 0.5]
    """
    if init_lr <= 0 or eta_min < 0 or eta_min > init_lr:
        raise ValueError(f"need init_lr > 0 and 0 <= eta_min <= init_lr, got {init_lr}, {eta_min}")
    if cycle_steps < 1 or t_mult < 1:
        raise ValueError(f"need cycle_steps >= 1 and t_mult >= 1, got {cycle_steps}, {t_mult}")

    def lr(k: int) -> float:
        t, length = max(0, k - start_step), cycle_steps
        if t_mult == 1:
            t %= length
        else:
            while t >= length:
                t, length = t - length, length * t_mult
        return eta_min + (init_lr - eta_min) * (1 + math.cos(math.pi * t / length)) / 2

    return lr


LR_FUNCTIONS = ("linear", "cosine", "cyclic_linear")


def function_lr(init_lr: float, final_lr: float, start_step: int, end_step: int, lr_func: str,
                cycle_steps: int | None = None) -> Schedule:
    """SparseML's ``LearningRateFunctionModifier``, step for step as SparseML 1.8 computes it: at step ``k`` the
    position in the cycle is ``(k - cycle start) / cycle length`` (SparseML's ``(epoch - start) / (end - start)``,
    its epoch counting ``k / steps_per_epoch``), from ``init_lr`` at 0 towards ``final_lr`` at 1, linearly or along
    half a cosine; the last step of a cycle is one step short of ``final_lr``, as in SparseML. ``cyclic_linear``
    restarts from ``init_lr`` every ``cycle_steps``. Before start: ``init_lr``; after the span: the last value.

    >>> s = function_lr(1.0, 0.0, 0, 4, "linear")
    >>> [s(k) for k in (0, 2, 3, 9)]
    [1.0, 0.5, 0.25, 0.25]
    """
    if lr_func not in LR_FUNCTIONS:
        raise ValueError(f"lr_func must be one of {LR_FUNCTIONS}, got {lr_func!r}")
    if init_lr < 0 or final_lr < 0 or end_step <= start_step:
        raise ValueError(f"need LRs >= 0 and end_step > start_step, got {init_lr}, {final_lr}, "
                         f"{start_step}, {end_step}")
    span = end_step - start_step
    cycle = span if lr_func != "cyclic_linear" or not cycle_steps else max(1, min(cycle_steps, span))

    def lr(k: int) -> float:
        t = min(max(0, k - start_step), span - 1)
        within = t % cycle
        length = min(cycle, span - (t - within))  # the last cycle may be cut short by the end
        p = within / length
        if lr_func == "cosine":
            return final_lr + (init_lr - final_lr) * (1 + math.cos(math.pi * p)) / 2
        return init_lr + (final_lr - init_lr) * p

    return lr


def _check_lr(init_lr: float, gamma: float) -> None:
    if init_lr <= 0 or gamma <= 0:
        raise ValueError(f"need init_lr > 0 and gamma > 0, got {init_lr}, {gamma}")


def pruned_count(sparsity: float, numel: int) -> int:
    """How many of ``numel`` weights are zero at ``sparsity``: round half up, exact for both backends."""
    return min(numel, int(math.floor(sparsity * numel + 0.5)))
