"""The base every recipe modifier shares: its field types, the epoch rules written once, the params check.

Epoch fields use SparseML's sentinel ``-1``: as a start it means "from the first step", as an end "until training
ends" (the recipe's ``max_epochs``). The rules for ``start_epoch`` / ``end_epoch`` are written once, on
:class:`Modifier`; each modifier says with two class variables whether it accepts the sentinel.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, StrictFloat, TypeAdapter, ValidationInfo, field_validator

from .patterns import compile_pattern

# --- field types -------------------------------------------------------------------------

Number = Annotated[StrictFloat, Field(allow_inf_nan=False)]
"""A finite number; ints are accepted (as floats), bools and strings are not."""
MAX_EPOCH = 100_000  # no training runs longer; a larger epoch is a typo, or a file meant to exhaust memory
Epoch = Annotated[StrictFloat, Field(allow_inf_nan=False, le=MAX_EPOCH)]
"""An epoch (or a span of epochs): a finite number up to :data:`MAX_EPOCH`."""
PositiveNumber = Annotated[StrictFloat, Field(allow_inf_nan=False, gt=0)]
NonNegativeNumber = Annotated[StrictFloat, Field(allow_inf_nan=False, ge=0)]
_NUMBER = TypeAdapter(Number)

def _unsupported(default: Any, why: str) -> Any:
    """A field recal accepts only at ``default``; ``why`` is the message for any other value."""
    return Field(default, description=f"not supported by recal: {why}")


ParamGroups = tuple[Annotated[int, Field(strict=True, ge=0)], ...] | None
"""Optimizer param-group indices a modifier sets (None: its default groups)."""
ParamSpec = str | tuple[str, ...]
"""``__ALL__``, ``__ALL_PRUNABLE__``, a name, ``re:<pattern>``, or a list of names/patterns."""

ALL = "__ALL__"
ALL_PRUNABLE = "__ALL_PRUNABLE__"
LR_CLASSES = ("ExponentialLR", "StepLR", "MultiStepLR", "CosineAnnealingWarmRestarts")
INTER_FUNCS = ("linear", "cubic", "inverse_cubic")


def check_patterns(entries) -> None:
    """The ``re:`` entries among ``entries`` compile within recal's limits (ValueError naming the entry)."""
    for entry in entries:
        if entry.startswith("re:"):
            try:
                compile_pattern(entry[3:])
            except ValueError as exc:
                raise ValueError(f"{entry!r}: {exc}") from None


def _check_params(value: ParamSpec) -> ParamSpec:
    items = (value,) if isinstance(value, str) else value
    if not items:
        raise ValueError("params is empty; give __ALL__, __ALL_PRUNABLE__, names or re: patterns")
    check_patterns(items)
    for item in items:
        if not item.strip():
            raise ValueError("params holds an empty name")
        if item in (ALL, ALL_PRUNABLE) and len(items) > 1:
            raise ValueError(f"{item} selects everything; do not list it with other names")
    return value


# --- base --------------------------------------------------------------------------------


class Modifier(BaseModel):
    """Base of all modifiers: immutable, unknown fields rejected, ints accepted as floats."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=False)

    tag: ClassVar[str]
    aliases: ClassVar[tuple[str, ...]] = ()
    start_sentinel: ClassVar[bool] = True  # whether start_epoch may be -1 ("from the first step")
    end_sentinel: ClassVar[bool] = True  # whether end_epoch may be -1 ("until training ends")
    # fields a recipe may leave out although the seed requires them: field -> (the value taken, the warning's why)
    warned_defaults: ClassVar[dict[str, tuple[Any, str]]] = {}
    # SparseML's logging hints: accepted and kept, they do not change training.
    log_types: str | tuple[str, ...] | None = None

    @property
    def yaml_tag(self) -> str:
        return "!" + self.tag

    @field_validator("start_epoch", check_fields=False)
    @classmethod
    def _check_start(cls, value: float) -> float:
        if value == -1 and cls.start_sentinel:
            return value
        if value < 0:
            raise ValueError("start_epoch must be >= 0" + (" (or -1)" if cls.start_sentinel else ""))
        return value

    @field_validator("end_epoch", check_fields=False)
    @classmethod
    def _check_end(cls, value: float, info: ValidationInfo) -> float:
        if value == -1 and cls.end_sentinel:
            return value
        if value < 0:
            raise ValueError("end_epoch must be >= 0" + (" (or -1)" if cls.end_sentinel else ""))
        start = info.data.get("start_epoch")
        if start is not None and value <= max(start, 0.0):
            raise ValueError(f"end_epoch ({value:g}) must be greater than start_epoch ({start:g})")
        return value

    @field_validator("param_groups", check_fields=False)
    @classmethod
    def _check_param_groups(cls, value: tuple[int, ...] | None) -> tuple[int, ...] | None:
        if value is not None and (not value or len(set(value)) != len(value)):
            raise ValueError("param_groups must be a non-empty list of distinct param-group indices")
        return value

    @field_validator("params", check_fields=False)
    @classmethod
    def _check_params(cls, value: ParamSpec) -> ParamSpec:
        return _check_params(value)
