"""A recipe bound to ``steps_per_epoch``: every modifier's state as a function of the step.

This is the single source of truth both backends query: after ``k`` optimizer steps
the mask sparsity, LR, weight decay, trainable set and QAT state in force are the
values returned here for ``k``. A modifier is active for ``[start_step, end_step)``
with ``start_step = epoch_to_step(start_epoch)``; ``end_epoch`` is exclusive, a ``-1``
start means step 0 and a ``-1`` end means the end of training
(``epoch_to_step(recipe.max_epochs)``).

When several LR modifiers have started, the one that started last is in force (a tie
goes to the later one in the recipe); a LearningRateModifier holds its last value after
its ``end_epoch``. Weight decay follows the same rule.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Protocol

import numpy as np

from . import modifiers as M
from . import schedules as S
from .errors import Problem, RecipeError


def _sets_group(m: M.Modifier, group: int) -> bool:
    groups = getattr(m, "param_groups", None)
    return groups is None or group in groups


class _Recipe(Protocol):
    """What a schedule reads of a :class:`~recal_core.recipe.Recipe` (which imports this module, not back)."""

    modifiers: tuple[M.Modifier, ...]
    max_epochs: int

    def of_type(self, cls: Any) -> Iterator[tuple[int, Any]]: ...

    def problem(self, index: int, field: str | None, message: str, **kw: Any) -> Problem: ...


@dataclass(frozen=True)
class Span:
    """A modifier's active steps ``[start, end)``; ``end`` is None for "until training ends"."""

    start: int
    end: int | None

    def contains(self, k: int) -> bool:
        return k >= self.start and (self.end is None or k < self.end)


@dataclass(frozen=True)
class PruningSchedule:
    """One pruning modifier, bound: which steps update the mask and the sparsity then."""

    index: int
    modifier: M.GradualKSModifier | M.ConstantKSModifier
    span: Span
    sparsity: Callable[[int], float | None]  # None: no mask in force at k (GradualKS)
    is_update: Callable[[int], bool]

    @property
    def constant(self) -> bool:
        """ConstantKS keeps the zeros found at its start; it sets no target of its own."""
        return isinstance(self.modifier, M.ConstantKSModifier)

    def mask_in_force(self, k: int) -> bool:
        if self.constant:
            return self.span.contains(k)
        return self.sparsity(k) is not None

    def tables(self, total_steps: int) -> tuple[np.ndarray, np.ndarray, list[int]]:
        """For graph backends: per step ``0..total_steps`` the index of the last mask update ``<= k``
        (-1 before the first) and whether a mask is in force; and the update steps themselves."""
        steps = total_steps + 1
        updates = np.flatnonzero(np.fromiter(map(self.is_update, range(steps)), dtype=bool, count=steps))
        ids = np.searchsorted(updates, np.arange(steps), side="right") - 1  # linear, whatever the update count
        in_force = np.fromiter(map(self.mask_in_force, range(steps)), dtype=bool, count=steps)
        return ids.astype(np.int64), in_force, updates.tolist()


@dataclass(frozen=True)
class QATState:
    """Quantization-aware training switches in force after ``k`` steps."""

    enabled: bool = False
    bn_frozen: bool = False
    observers_frozen: bool = False


class RecipeSchedule:
    """``recipe.bind(steps_per_epoch)``: query any modifier's value at step ``k``.

    >>> from recal_core import load_recipe
    >>> r = load_recipe('''
    ... - !EpochRangeModifier {start_epoch: 0, end_epoch: 4}
    ... - !SetLearningRateModifier {start_epoch: 1, learning_rate: 0.5}''')
    >>> s = r.bind(steps_per_epoch=10)
    >>> s.total_steps, s.lr(9, base_lr=0.1), s.lr(10, base_lr=0.1)
    (40, None, 0.5)
    """

    def __init__(self, recipe: _Recipe, steps_per_epoch: int):
        if isinstance(steps_per_epoch, bool) or not isinstance(steps_per_epoch, int) or steps_per_epoch <= 0:
            raise ValueError(f"steps_per_epoch must be a positive int, got {steps_per_epoch!r}")
        self.recipe = recipe
        self.steps_per_epoch = steps_per_epoch
        self.total_steps = self.step(recipe.max_epochs)
        self.pruning = tuple(self._pruning(i, m) for i, m in recipe.of_type(
            (M.GradualKSModifier, M.ConstantKSModifier, M.ACDCPruningModifier)))
        self._lr = sorted(((self._start(m), i, m) for i, m in recipe.of_type(
            (M.SetLearningRateModifier, M.LearningRateModifier, M.LearningRateFunctionModifier))),
            key=lambda t: (t[0], t[1]))
        self._wd = sorted(((self._start(m), i, m) for i, m in recipe.of_type(M.SetWeightDecayModifier)),
                          key=lambda t: (t[0], t[1]))
        self.trainable = tuple((i, m, self.span(m)) for i, m in recipe.of_type(M.TrainableParamsModifier))
        self.quantization = tuple((i, m) for i, m in recipe.of_type(M.QuantizationModifier))
        self.distillation = tuple((i, m, self.span(m)) for i, m in recipe.of_type(M.DistillationModifier))
        self._lr_schedules: dict[tuple[int, float | None, int], S.Schedule] = {}
        self._check_lr_range()

    def _check_lr_range(self) -> None:
        """An LR schedule whose value underflows to 0 or overflows (``gamma: 1e-300``, ``1e300``) is a
        located error at bind time, not a run that silently stops learning or dies on an OverflowError."""
        problems = []
        for start, index, m in self._lr:
            if not isinstance(m, M.LearningRateModifier):
                continue
            init = m.init_lr if m.init_lr is not None else 1.0  # without init_lr: the factor on the base LR
            span = self.span(m)
            end = span.end if span.end is not None else self.total_steps
            try:
                last = self._lr_function(m, init, start)(max(end - 1, start))
            except OverflowError:
                last = math.inf
            if not (sys.float_info.min <= last < math.inf):
                what = "underflows to 0" if last < sys.float_info.min else "overflows"
                problems.append(self.recipe.problem(
                    index, "lr_kwargs", f"the learning rate {what} by the end of this schedule "
                    f"({'init_lr' if m.init_lr is not None else 'the optimizer LR'} x {m.lr_class} at epoch "
                    f"{self.epoch_of(end):g})", expected="a gamma and span that keep the LR a positive float"))
        if problems:
            raise RecipeError(problems)

    # --- epochs to steps --------------------------------------------------------------------

    def step(self, epoch: float) -> int:
        return S.epoch_to_step(epoch, self.steps_per_epoch)

    def _start(self, m: M.Modifier) -> int:
        start = getattr(m, "start_epoch", -1.0)
        return 0 if start == -1 else self.step(start)

    def span(self, m: M.Modifier) -> Span:
        end = getattr(m, "end_epoch", -1.0)
        return Span(self._start(m), None if end == -1 else self.step(end))

    def epoch_of(self, k: int) -> float:
        return k / self.steps_per_epoch

    # --- pruning ----------------------------------------------------------------------------

    def _pruning(self, index: int, m: M.GradualKSModifier | M.ConstantKSModifier) -> PruningSchedule:
        span = self.span(m)
        if isinstance(m, M.ConstantKSModifier):
            return PruningSchedule(index, m, span, lambda k: None, lambda k, s=span.start: k == s)
        if isinstance(m, M.ACDCPruningModifier):
            sparsity, is_update = S.acdc_phases(m.compression_sparsity, span.start, span.end,
                                                max(1, self.step(m.update_frequency)), m.leave_enabled)
            return PruningSchedule(index, m, span, sparsity, is_update)
        every = 1 if m.update_frequency == -1 else max(1, self.step(m.update_frequency))
        end = span.end if span.end is not None else self.total_steps
        return PruningSchedule(
            index, m, span,
            S.gradual_sparsity(m.init_sparsity, m.final_sparsity, span.start, end, every,
                               m.inter_func, m.leave_enabled),
            S.update_steps(span.start, end, every),
        )

    # --- learning rate and weight decay -----------------------------------------------------

    def lr(self, k: int, base_lr: float | None = None, group: int = 0) -> float | None:
        """The LR of param group ``group`` in force after ``k`` steps, or None if no LR modifier for that
        group has started yet (a modifier with ``param_groups`` sets only the groups it names).

        ``base_lr`` (the group's own LR) seeds a LearningRateModifier without ``init_lr``
        that no earlier LR modifier precedes.
        """
        started = [entry for entry in self._lr if entry[0] <= k and _sets_group(entry[2], group)]
        if not started:
            return None
        start, index, m = started[-1]
        key = (index, base_lr, group)
        if key not in self._lr_schedules:  # built once per modifier and group, not at every step
            self._lr_schedules[key] = self._lr_schedule(start, m, base_lr, group)
        return self._lr_schedules[key](k)

    def _lr_schedule(self, start: int, m: M.Modifier, base_lr: float | None, group: int) -> S.Schedule:
        """The LR schedule of LR modifier ``m`` (starting at step ``start``) for param group ``group``."""
        if isinstance(m, M.SetLearningRateModifier):
            return S.constant(m.learning_rate)
        span = self.span(m)
        if isinstance(m, M.LearningRateFunctionModifier):
            cycle = None if m.cycle_epochs == -1 else max(1, self.step(m.cycle_epochs))
            return S.function_lr(m.init_lr, m.final_lr, start, max(span.end, start + 1), m.lr_func, cycle)
        init = m.init_lr
        if init is None:
            init = self.lr(start - 1, base_lr, group) if start > 0 else None
            init = base_lr if init is None else init
            if init is None:
                raise ValueError(f"{m.yaml_tag} has no init_lr and no earlier LR to start from; "
                                 "give init_lr or the optimizer's LR")
        end = span.end if span.end is not None else self.total_steps
        schedule, last = self._lr_function(m, init, start), max(end - 1, start)
        return lambda k: schedule(min(k, last))

    def lr_function(self, base_lr: float | None, group: int = 0) -> Callable[[int], float | None]:
        """The LR in force after ``k`` steps for a param group whose own LR is ``base_lr`` (None
        before any LR modifier starts). Checked once: if a value needs ``base_lr`` and it is None,
        a :class:`RecipeError` located at the LearningRateModifier's ``init_lr`` says so."""
        if base_lr is None and self.needs_base_lr():
            index = next(i for s, i, m in self._lr
                         if isinstance(m, M.LearningRateModifier) and m.init_lr is None)
            raise RecipeError(self.recipe.problem(
                index, "init_lr", "no init_lr and no earlier LR modifier to start from",
                expected="init_lr, or the optimizer's own LR (base_lr)"))
        return lambda k: self.lr(k, base_lr=base_lr, group=group)

    def weight_decay_function(self, group: int, bases: list[float | None]) -> Callable[[int], float | None]:
        """The weight decay in force after ``k`` steps for param group ``group`` (None: leave it as is).

        A SetWeightDecayModifier with ``param_groups`` sets the groups it names. Without, it sets every
        group whose own weight decay (``bases``; None: unknown) is not 0, or every group when all are 0:
        groups a user keeps free of decay stay so.
        """
        zero = [b == 0 for b in bases]
        default = (not zero[group]) or all(zero)
        applies = [(start, m) for start, _, m in self._wd
                   if (group in m.param_groups if m.param_groups is not None else default)]

        def weight_decay(k: int) -> float | None:
            started = [m for start, m in applies if start <= k]
            return started[-1].weight_decay if started else None

        return weight_decay

    def _lr_function(self, m: M.LearningRateModifier, init: float, start: int) -> S.Schedule:
        kw = m.lr_kwargs
        if m.lr_class == "CosineAnnealingWarmRestarts":
            return S.cosine_warm_restarts_lr(init, min(kw["lr_min"], init), start,
                                             max(1, self.step(kw["cycle_epochs"])), kw["T_mult"])
        if m.lr_class == "ExponentialLR":
            return S.exponential_lr(init, kw["gamma"], start, self.steps_per_epoch)
        if m.lr_class == "StepLR":
            return S.step_lr(init, kw["gamma"], start, max(1, self.step(kw["step"])))
        return S.multistep_lr(init, kw["gamma"], [self.step(e) for e in kw["milestones"]])

    @property
    def controls_lr(self) -> bool:
        """Whether the recipe has LR modifiers (it sets the LR from the first one's start)."""
        return bool(self._lr)

    def needs_base_lr(self) -> bool:
        """True when some LR value depends on the optimizer's own LR (no init_lr, nothing before)."""
        for pos, (start, _, m) in enumerate(self._lr):
            if isinstance(m, M.LearningRateModifier) and m.init_lr is None:
                if not any(s < start for s, _, _ in self._lr[:pos]):
                    return True
        return False

    def weight_decay(self, k: int) -> float | None:
        """The weight decay in force after ``k`` steps, or None before any SetWeightDecayModifier."""
        started = [m for start, _, m in self._wd if start <= k]
        return started[-1].weight_decay if started else None

    # --- trainable and quantization ---------------------------------------------------------

    def trainable_rules(self, k: int) -> list[tuple[int, M.TrainableParamsModifier]]:
        """TrainableParamsModifiers in force at ``k``, earliest first (a later start overrides)."""
        active = [(span.start, i, m) for i, m, span in self.trainable if span.contains(k)]
        return [(i, m) for _, i, m in sorted(active, key=lambda t: (t[0], t[1]))]

    def distillation_at(self, k: int) -> M.DistillationModifier | None:
        """The DistillationModifier in force at step ``k`` (the one that started last), or None."""
        active = [(span.start, i, m) for i, m, span in self.distillation if span.contains(k)]
        return max(active, key=lambda t: (t[0], t[1]))[2] if active else None

    def qat(self, index: int, k: int) -> QATState:
        """State of QuantizationModifier ``index`` (its position in the recipe) after ``k`` steps."""
        m = self.recipe.modifiers[index]
        if not isinstance(m, M.QuantizationModifier):
            raise ValueError(f"modifier {index} is {m.yaml_tag}, not a QuantizationModifier")
        enabled = k >= self._start(m)
        return QATState(
            enabled,
            enabled and m.freeze_bn_stats_epoch is not None and k >= self.step(m.freeze_bn_stats_epoch),
            enabled and m.disable_quantization_observer_epoch is not None
            and k >= self.step(m.disable_quantization_observer_epoch),
        )
