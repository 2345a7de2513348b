"""Resolve a modifier's ``params`` against a model's parameters, the same way in every framework.

A backend describes each parameter as a :class:`ParamInfo` (its name, the layer it
belongs to, whether it is a conv/dense kernel); this module decides what a spec selects.

- ``__ALL_PRUNABLE__``: every conv / dense kernel (no biases, no norm parameters).
- ``__ALL__``: the same for pruning modifiers; every parameter for TrainableParamsModifier.
- a name: a parameter name (``blocks.1.conv.weight``) or a layer name (``blocks.1.conv``),
  which stands for the layer's kernel when pruning and all its parameters otherwise.
- ``re:<pattern>``: a full match against the parameter name or the layer name.

A wrapper prefix ``module.`` (DistributedDataParallel) is ignored on both sides.
Every entry must select something; otherwise a :class:`RecipeError` names the closest names.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import Sequence

from .errors import RecipeError
from .modifiers import ALL, ALL_PRUNABLE, ParamSpec
from .patterns import PATTERN_SECONDS, PatternBudget, PatternTimeoutError  # noqa: F401 (re-exported)

WRAPPER_PREFIX = "module."


@dataclass(frozen=True)
class ParamInfo:
    """One model parameter as the core sees it.

    ``shape`` is as the backend stores it; ``kernel_axes`` (kernels only) orders those axes as the
    canonical ``[out, in, *spatial]`` that structured masks are defined on (torch convs: as stored;
    TensorFlow's HWIO: ``(3, 2, 0, 1)``; None: no known layout, structured masks refused).
    """

    name: str
    layer: str
    prunable: bool  # a conv or dense kernel
    shape: tuple[int, ...] = ()
    kernel_axes: tuple[int, ...] | None = None
    prunable_when_named: bool = False  # an embedding table: pruned when an entry names it, not by __ALL_PRUNABLE__


def _names(p: ParamInfo) -> tuple[str, ...]:
    """What an entry may name a parameter by: its name or its layer's, with or without a wrapper prefix."""
    return (strip_wrapper(p.name), strip_wrapper(p.layer), p.name, p.layer)


def strip_wrapper(name: str) -> str:
    while name.startswith(WRAPPER_PREFIX):
        name = name[len(WRAPPER_PREFIX):]
    return name


def spec_entries(spec: ParamSpec) -> tuple[str, ...]:
    return (spec,) if isinstance(spec, str) else tuple(spec)


def select(spec: ParamSpec, params: Sequence[ParamInfo], *, pruning: bool,
           budget: PatternBudget | None = None) -> tuple[list[ParamInfo], list[str]]:
    """The parameters ``spec`` selects (model order) and a message for each entry that selects none.

    When ``pruning``, only conv/dense kernels can be selected; an entry that names or
    matches only other parameters (a bias, a norm scale) fails with a message saying so.
    ``budget``: the time left to the recipe's ``re:`` patterns (a fresh one when None).
    """
    budget = budget or PatternBudget()
    chosen: set[str] = set()
    failures: list[str] = []
    names = tuple(dict.fromkeys(n for p in params for n in _names(p)))
    for entry in spec_entries(spec):
        if entry == ALL_PRUNABLE or (entry == ALL and pruning):
            hits = [p for p in params if p.prunable]
        elif entry == ALL:
            hits = list(params)
        else:
            if entry.startswith("re:"):
                try:
                    matched = budget.fullmatches(entry, names)
                except (PatternTimeoutError, ValueError) as exc:
                    failures.append(str(exc))
                    continue
            else:
                matched = {strip_wrapper(entry)}
            hits = [p for p in params if any(n in matched for n in _names(p))]
            if pruning and hits and not any(p.prunable or p.prunable_when_named for p in hits):
                failures.append(f"{entry!r} selects no conv/dense kernel or embedding table, only "
                                f"{', '.join(p.name for p in hits[:4])}")
                continue
            hits = [p for p in hits if p.prunable or p.prunable_when_named or not pruning]
        if not hits:
            failures.append(_no_match_message(entry, params, pruning))
        chosen.update(p.name for p in hits)
    return [p for p in params if p.name in chosen], failures


def _no_match_message(entry: str, params: Sequence[ParamInfo], pruning: bool) -> str:
    if entry in (ALL, ALL_PRUNABLE):
        return f"{entry} selects nothing: the model has no {'conv/dense kernels' if pruning else 'parameters'}"
    pool = sorted({strip_wrapper(n) for p in params for n in (p.name, p.layer)
                   if not pruning or p.prunable})
    needle = entry[3:] if entry.startswith("re:") else strip_wrapper(entry)
    close = difflib.get_close_matches(needle, pool, n=5, cutoff=0.4) or pool[:5]
    kind = "pattern" if entry.startswith("re:") else "name"
    return f"{kind} {entry!r} matches no {'prunable ' if pruning else ''}parameter; closest: {', '.join(close)}"


def resolve_params(recipe, index: int, params: Sequence[ParamInfo], *, pruning: bool,
                   budget: PatternBudget | None = None) -> list[ParamInfo]:
    """The parameters modifier ``index`` of ``recipe`` selects; a located RecipeError if an entry fails.
    ``budget``: the time left to the recipe's ``re:`` patterns, shared by all its modifiers."""
    spec = recipe.modifiers[index].params
    hits, failures = select(spec, params, pruning=pruning, budget=budget)
    if failures:
        raise RecipeError([recipe.problem(index, "params", f) for f in failures])
    return hits
