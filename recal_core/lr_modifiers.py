"""The learning-rate modifiers: a constant from a step, torch-style epoch schedules, SparseML's per-step functions."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import StrictBool, ValidationError, ValidationInfo, field_validator

from .modifier_base import (_NUMBER, LR_CLASSES, MAX_EPOCH, Epoch, Modifier, NonNegativeNumber, ParamGroups,
                            PositiveNumber, _unsupported)



class SetLearningRateModifier(Modifier):
    """Set the learning rate to ``learning_rate`` from ``start_epoch`` (-1: from the first step)."""

    tag: ClassVar[str] = "SetLearningRateModifier"
    start_epoch: Epoch = -1.0
    learning_rate: PositiveNumber
    param_groups: ParamGroups = None
    end_epoch: Literal[-1.0] = _unsupported(-1.0, "the learning rate holds until another LR modifier starts")
    constant_logging: StrictBool = False


class LearningRateModifier(Modifier):
    """An epoch-wise LR schedule (ExponentialLR, StepLR or MultiStepLR) over ``[start_epoch, end_epoch)``."""

    tag: ClassVar[str] = "LearningRateModifier"
    start_epoch: Epoch
    end_epoch: Epoch = -1.0
    lr_class: str
    lr_kwargs: dict[str, Any]
    init_lr: PositiveNumber | None = None
    update_frequency: Literal[-1.0] = _unsupported(-1.0, "LR schedules step per epoch (leave update_frequency out)")
    constant_logging: StrictBool = False

    @field_validator("lr_class")
    @classmethod
    def _lr_class(cls, v: str) -> str:
        if v not in LR_CLASSES:
            raise ValueError(f"lr_class {v!r} is not supported; use one of {', '.join(LR_CLASSES)}")
        return v

    @field_validator("lr_kwargs")
    @classmethod
    def _lr_kwargs(cls, v: dict[str, Any], info: ValidationInfo) -> dict[str, Any]:
        lr_class = info.data.get("lr_class")
        if lr_class is None:
            return v
        return _normalise_lr_kwargs(lr_class, v, info.data.get("start_epoch"), info.data.get("end_epoch"))


def _number(value: Any, name: str) -> float:
    """``value`` as a :data:`Number` (for numbers nested in a mapping such as ``lr_kwargs``)."""
    try:
        return _NUMBER.validate_python(value)
    except ValidationError as exc:
        raise ValueError(f"{name}: {exc.errors()[0]['msg']}") from None


def _normalise_lr_kwargs(lr_class: str, kwargs: dict[str, Any], start: float | None,
                         end: float | None) -> dict[str, Any]:
    kwargs = dict(kwargs)
    if lr_class == "StepLR" and "step_size" in kwargs and "step" not in kwargs:
        kwargs["step"] = kwargs.pop("step_size")
    if lr_class == "CosineAnnealingWarmRestarts":
        return _warm_restarts_kwargs(kwargs)
    required = {"ExponentialLR": ("gamma",), "StepLR": ("gamma", "step"),
                "MultiStepLR": ("gamma", "milestones")}[lr_class]
    missing = [k for k in required if k not in kwargs]
    unknown = sorted(set(kwargs) - set(required))
    if missing or unknown:
        parts = []
        if missing:
            parts.append("missing " + ", ".join(repr(k) for k in missing))
        if unknown:
            parts.append("unknown " + ", ".join(repr(k) for k in unknown))
        raise ValueError(f"lr_kwargs for {lr_class} takes exactly {', '.join(required)}: {'; '.join(parts)}")
    gamma = _number(kwargs["gamma"], "lr_kwargs.gamma")
    if gamma <= 0:
        raise ValueError("lr_kwargs.gamma must be > 0")
    out: dict[str, Any] = {"gamma": gamma}
    if lr_class == "StepLR":
        step = _number(kwargs["step"], "lr_kwargs.step")
        if not 0 < step <= MAX_EPOCH:
            raise ValueError(f"lr_kwargs.step must be > 0 epochs and at most {MAX_EPOCH}")
        out["step"] = step
    if lr_class == "MultiStepLR":
        milestones = kwargs["milestones"]
        if not isinstance(milestones, (list, tuple)) or not milestones:
            raise ValueError("lr_kwargs.milestones must be a non-empty list of epochs")
        values = [_number(m, "lr_kwargs.milestones") for m in milestones]
        if any(m > MAX_EPOCH for m in values):
            raise ValueError(f"lr_kwargs.milestones must be epochs up to {MAX_EPOCH}")
        lo = max(start, 0.0) if start is not None else 0.0
        for m in values:
            if m < lo or (end is not None and end != -1 and m >= end):
                hi = "end_epoch" if end not in (None, -1) else "the end of training"
                raise ValueError(f"milestone {m:g} is outside [start_epoch, {hi}) = [{lo:g}, "
                                 f"{end if end not in (None, -1) else 'inf'})")
        if values != sorted(set(values)):
            raise ValueError("lr_kwargs.milestones must be strictly increasing")
        out["milestones"] = values
    return out


# CosineAnnealingWarmRestarts: torch's argument names, or SparseML's (cycle_epochs, lr_min)
_WARM_RESTART_NAMES = {"T_0": "cycle_epochs", "cycle_epochs": "cycle_epochs", "T_mult": "T_mult",
                       "eta_min": "lr_min", "lr_min": "lr_min"}


def _warm_restarts_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in kwargs.items():
        name = _WARM_RESTART_NAMES.get(key)
        if name is None:
            raise ValueError(f"lr_kwargs for CosineAnnealingWarmRestarts takes cycle_epochs (or T_0), T_mult, "
                             f"lr_min (or eta_min): unknown {key!r}")
        if name in out:
            raise ValueError(f"lr_kwargs gives {name} twice (as {key!r} and another name)")
        out[name] = value
    if "cycle_epochs" not in out:
        raise ValueError("lr_kwargs for CosineAnnealingWarmRestarts needs cycle_epochs (or T_0): the epochs of the "
                         "first cycle")
    cycle = _number(out["cycle_epochs"], "lr_kwargs.cycle_epochs")
    if not 0 < cycle <= MAX_EPOCH:
        raise ValueError(f"lr_kwargs.cycle_epochs must be > 0 and at most {MAX_EPOCH}")
    t_mult = out.get("T_mult", 1)
    if isinstance(t_mult, bool) or not isinstance(t_mult, int) or not 1 <= t_mult <= 16:
        raise ValueError("lr_kwargs.T_mult must be an integer from 1 to 16")
    lr_min = _number(out.get("lr_min", 0.0), "lr_kwargs.lr_min")
    if lr_min < 0:
        raise ValueError("lr_kwargs.lr_min must be >= 0")
    return {"cycle_epochs": cycle, "T_mult": t_mult, "lr_min": lr_min}


class LearningRateFunctionModifier(Modifier):
    """The LR from ``init_lr`` to ``final_lr`` over ``[start_epoch, end_epoch)`` along ``lr_func``:
    ``linear``, ``cosine``, or ``cyclic_linear`` (linear, restarting every ``cycle_epochs``)."""

    tag: ClassVar[str] = "LearningRateFunctionModifier"
    start_sentinel: ClassVar[bool] = False
    end_sentinel: ClassVar[bool] = False
    lr_func: Literal["linear", "cosine", "cyclic_linear"]
    init_lr: NonNegativeNumber  # 0: a warm-up from 0
    final_lr: NonNegativeNumber
    start_epoch: Epoch
    end_epoch: Epoch
    cycle_epochs: Epoch = -1.0
    param_groups: ParamGroups = None
    update_frequency: Literal[-1.0] = _unsupported(-1.0, "the LR is updated every step (leave update_frequency out)")

    @field_validator("cycle_epochs")
    @classmethod
    def _cycle(cls, v: float, info: ValidationInfo) -> float:
        if v != -1 and v <= 0:
            raise ValueError("cycle_epochs must be > 0 epochs (or -1: the whole span)")
        if v != -1 and info.data.get("lr_func") != "cyclic_linear":
            raise ValueError(f"cycle_epochs applies to lr_func cyclic_linear, not {info.data.get('lr_func')!r}")
        return v
