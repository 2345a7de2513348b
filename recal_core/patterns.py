"""``re:`` patterns of a recipe's ``params``: bounded before they are compiled, timed as one budget per recipe.

A pattern is data from an untrusted file. Compiling ``(?:a{1000}){1000}`` takes hundreds of MB, and matching
``(a|aa)+$`` takes exponential time on some names, so:

- :func:`compile_pattern` refuses, before compiling, a pattern longer than :data:`MAX_PATTERN_CHARS` or whose
  nested counted repeats multiply past :data:`MAX_REPEAT_PRODUCT` (the size of what the engine would build);
  compiled patterns are cached, so twenty aliases of one pattern compile once;
- a :class:`PatternBudget` holds the seconds every pattern of one recipe may take together, and the outcome of
  each pattern it has run, so a slow pattern repeated through aliases costs its time once.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from functools import lru_cache

import regex
from .errors import PatternTimeoutError

PATTERN_SECONDS = 1.0  # what all of one recipe's re: patterns may take over a model's names, together
MAX_PATTERN_CHARS = 1_000
MAX_REPEAT_PRODUCT = 10_000  # a{100}{100} is the most a pattern may unroll

_COUNTED = re.compile(r"\{(\d*),?(\d*)\}")
try:  # the stdlib parser gives the nesting of repeats; regex's own syntax extends it, so it is a first look only
    from re import _parser as _sre_parse  # Python 3.11+
except ImportError:  # pragma: no cover
    import sre_parse as _sre_parse  # type: ignore[no-redef]


def _unrolled(parsed) -> int:
    """The largest product of counted-repeat bounds along one nesting path of a parsed pattern."""
    worst = 1
    for op, arg in parsed:
        if op in (_sre_parse.MAX_REPEAT, _sre_parse.MIN_REPEAT, getattr(_sre_parse, "POSSESSIVE_REPEAT", None)):
            low, high, body = arg
            bound = low if high == _sre_parse.MAXREPEAT else high
            worst = max(worst, max(bound, 1) * _unrolled(body))
        elif op == _sre_parse.SUBPATTERN:
            worst = max(worst, _unrolled(arg[-1]))
        elif op == _sre_parse.BRANCH:
            worst = max([worst] + [_unrolled(b) for b in arg[1]])
        elif op in (_sre_parse.ASSERT, _sre_parse.ASSERT_NOT):
            worst = max(worst, _unrolled(arg[1]))
    return worst


def check_pattern(pattern: str) -> None:
    """Raise ValueError, before any compiling, if ``pattern`` (without ``re:``) is beyond recal's limits."""
    if len(pattern) > MAX_PATTERN_CHARS:
        raise ValueError(f"the pattern is {len(pattern):,} characters long; expected at most {MAX_PATTERN_CHARS:,}")
    try:
        unrolled = _unrolled(_sre_parse.parse(pattern))
    except Exception:  # noqa: BLE001 - regex-only syntax, or invalid: bound each counted repeat alone; regex says what is invalid
        counts = [int(n) for m in _COUNTED.finditer(pattern) for n in m.groups() if n]
        unrolled = max(counts, default=1)
    if unrolled > MAX_REPEAT_PRODUCT:
        raise ValueError(f"the pattern's counted repeats unroll to {unrolled:,} copies; expected at most "
                         f"{MAX_REPEAT_PRODUCT:,} (write a{{2,}} rather than a{{1000}}{{1000}})")


@lru_cache(maxsize=1024)
def compile_pattern(pattern: str) -> regex.Pattern:
    """``pattern`` (without ``re:``) compiled, after :func:`check_pattern`; ValueError says what is wrong."""
    check_pattern(pattern)
    try:
        return regex.compile(pattern)
    except regex.error as exc:
        raise ValueError(f"invalid regular expression {pattern!r}: {exc}") from None


@dataclass
class PatternBudget:
    """The time one recipe's patterns may take together; the clock starts at the first match."""

    seconds: float = PATTERN_SECONDS
    deadline: float | None = None
    outcomes: dict = field(default_factory=dict)  # (pattern, names) -> matched names, or the PatternTimeoutError

    def left(self) -> float:
        if self.deadline is None:
            self.deadline = time.monotonic() + self.seconds
        return self.deadline - time.monotonic()

    def fullmatches(self, entry: str, candidates: tuple[str, ...]) -> frozenset[str]:
        """The ``candidates`` that ``entry`` (``re:...``) matches in full; PatternTimeoutError past the budget."""
        key = (entry, candidates)
        if key in self.outcomes:
            outcome = self.outcomes[key]
            if isinstance(outcome, PatternTimeoutError):
                raise outcome
            return outcome
        pattern = compile_pattern(entry[3:])
        matched = set()
        for name in candidates:
            try:
                if pattern.fullmatch(name, timeout=max(self.left(), 1e-3)):
                    matched.add(name)
            except TimeoutError:
                self.outcomes[key] = PatternTimeoutError(
                    f"pattern {entry!r} ran out of the recipe's {self.seconds:g} s for matching patterns to the "
                    f"model's names (at {name!r}); simplify it (nested quantifiers such as '(a+)+' take "
                    "exponential time)")
                raise self.outcomes[key] from None
        self.outcomes[key] = frozenset(matched)
        return self.outcomes[key]
