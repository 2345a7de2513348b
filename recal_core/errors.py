"""The one exception a recipe can raise, with every problem located precisely.

A person fixing a recipe needs to know *where* (file, line, column), *what*
(modifier tag and field), the value found and what was expected; and needs all
problems at once, not one per run.
"""

from __future__ import annotations

from dataclasses import dataclass, field as dataclass_field
from typing import Any

_MISSING = object()


@dataclass(frozen=True)
class Location:
    """A place in a recipe source; ``line`` and ``column`` are 1-based."""

    source: str = "<string>"
    line: int | None = None
    column: int | None = None

    def __str__(self) -> str:
        parts = [self.source]
        if self.line is not None:
            parts.append(str(self.line))
            if self.column is not None:
                parts.append(str(self.column))
        return ":".join(parts)


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a recipe."""

    location: Location
    message: str
    modifier: str | None = None  # e.g. "!GradualKSModifier (modifier #2)"
    field: str | None = None
    value: Any = dataclass_field(default=_MISSING, compare=False)
    expected: str | None = None

    def __str__(self) -> str:
        text = f"{self.location}: "
        if self.modifier:
            text += self.modifier
            text += f", field '{self.field}'" if self.field else ""
            text += ": "
        elif self.field:
            text += f"'{self.field}': "
        text += self.message
        if self.value is not _MISSING:
            text += f"; got {_short(self.value)}"
        if self.expected:
            text += f"; expected {self.expected}"
        # non-ASCII shown escaped: a Cyrillic 'а' in a tag or name looks like a Latin 'a' but is another name
        return text.encode("ascii", "backslashreplace").decode("ascii")


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


class RecipeError(ValueError):
    """A recipe is invalid, or cannot be applied; ``problems`` lists every reason."""

    def __init__(self, problems: list[Problem] | Problem | str):
        if isinstance(problems, str):
            problems = [Problem(Location(), problems)]
        elif isinstance(problems, Problem):
            problems = [problems]
        self.problems: list[Problem] = list(problems)
        super().__init__(self._format())

    def _format(self) -> str:
        if len(self.problems) == 1:
            return str(self.problems[0])
        sources = sorted({p.location.source for p in self.problems})
        head = f"{len(self.problems)} problems in {', '.join(sources)}:"
        return "\n".join([head] + [f"  - {p}" for p in self.problems])


class VerificationError(ValueError):
    """A produced model does not match the model it came from beyond tolerance; nothing was written (the CLI exits
    with 1, not 2). Raised by :func:`recal_onnx.quantize_qat_export` and re-exported there."""


class ThinningWarning(UserWarning):
    """Dead heads left in place, the model unchanged there (the message names them and says why)."""


class RecipeWarning(UserWarning):
    """A recipe field is accepted but does not act as written (the message says where and what happens)."""


class ExpressionError(ValueError):
    """An ``eval(...)`` value that cannot be computed; the message says why."""


class BudgetSpentError(ExpressionError):
    """The recipe's :class:`~recal_core.expressions.ExpressionBudget` ran out; reported once, at the expression
    where it did (``first``)."""

    def __init__(self, message: str, first: bool):
        super().__init__(message)
        self.first = first


class CouplingError(ValueError):
    """A layer whose channels cannot be pruned as asked; the message names it and what blocks it, and
    ``modifier`` is the recipe index of the modifier that asked."""

    def __init__(self, message: str, modifier: int | None = None):
        super().__init__(message)
        self.modifier = modifier


class InputFileError(OSError):
    """The path is not a regular file, or is larger than its limit; the message says which and where."""


class PatternTimeoutError(ValueError):
    """A recipe's ``re:`` patterns took longer than their budget over a model's names."""


class PlanError(ValueError):
    """A budget the candidates cannot meet: the message gives the nearest budget that can be."""
