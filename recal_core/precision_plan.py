"""A recipe planned from measurement: each layer's precision chosen under a size budget, written as a recipe.

A front end measures, per layer and per candidate (float, or weights in 8, 4 or 2 bits), what the candidate costs
(bytes) and how much it hurts (a score: the loss increase measured with that layer alone quantized, or a cheap
estimate of it). :func:`solve` picks one candidate per layer minimising the summed score under the budget, exactly,
as an integer program (``scipy.optimize.milp``: the knapsack is small, and the solver proves its answer optimal).
:func:`recipe_text` writes the choice as an ordinary recipe: one weight-only ``QuantizationModifier`` whose
``scheme_overrides`` name each layer's bits and whose ``ignore`` lists the float ones, a comment per layer with its
score and cost. ``recal check`` reads it like any other; training it is the usual loop.
"""

from __future__ import annotations

from dataclasses import dataclass
from .errors import PlanError

FLOAT = 32  # a candidate's bits for "left float"


@dataclass(frozen=True)
class Candidate:
    """One way to hold one layer: ``bits`` (32: float), its ``cost`` in bytes and its ``score`` (loss increase)."""

    bits: int
    cost: float
    score: float


@dataclass(frozen=True)
class LayerCandidates:
    name: str
    params: int
    candidates: tuple[Candidate, ...]


def size_bounds(layers: list[LayerCandidates]) -> tuple[float, float]:
    """The bytes of the smallest plan (each layer at its cheapest candidate) and of the largest."""
    return (sum(min(c.cost for c in layer.candidates) for layer in layers),
            sum(max(c.cost for c in layer.candidates) for layer in layers))


def solve(layers: list[LayerCandidates], budget: float) -> dict[str, Candidate]:
    """One candidate per layer, least summed score with summed cost <= ``budget`` bytes (exact: an integer
    program); :class:`PlanError` naming the smallest possible size where none fits."""
    import numpy as np
    from scipy.optimize import Bounds, LinearConstraint, milp

    smallest = size_bounds(layers)[0]
    if budget < smallest:
        raise PlanError(f"a size budget of {budget:,.0f} bytes cannot be met: the smallest plan, every layer at its "
                        f"fewest bits, is {smallest:,.0f} bytes; give at least that")
    flat = [(i, c) for i, layer in enumerate(layers) for c in layer.candidates]
    scores = np.array([c.score for _, c in flat])
    costs = np.array([c.cost for _, c in flat])
    one_each = np.zeros((len(layers), len(flat)))
    for j, (i, _) in enumerate(flat):
        one_each[i, j] = 1.0
    # scores shifted to be >= 0 per layer (a candidate may measure below float by noise): the same argmin
    shift = np.array([min(c.score for c in layers[i].candidates) for i, _ in flat])
    result = milp(scores - shift, integrality=np.ones(len(flat)), bounds=Bounds(0, 1),
                  constraints=[LinearConstraint(one_each, 1, 1), LinearConstraint(costs[None, :], -np.inf, budget)])
    if not result.success:
        raise PlanError(f"no plan found for a size budget of {budget:,.0f} bytes: {result.message}")
    chosen = np.flatnonzero(result.x > 0.5)
    return {layers[flat[j][0]].name: flat[j][1] for j in chosen}


def pareto(layers: list[LayerCandidates], points: int = 12) -> list[tuple[float, float, dict[str, Candidate]]]:
    """``(cost, score, choice)`` of the best plan at ``points`` budgets spread from the smallest plan to all float:
    the curve a budget is chosen on."""
    low, high = size_bounds(layers)
    curve = []
    for k in range(points):
        choice = solve(layers, low + (high - low) * k / max(1, points - 1))
        curve.append((sum(c.cost for c in choice.values()), sum(c.score for c in choice.values()), choice))
    return curve


def recipe_text(layers: list[LayerCandidates], choice: dict[str, Candidate], *, group_size: int = 32,
                observer: str = "mse", epochs: float = 1.0, budget: float | None = None,
                estimate: str = "measured") -> str:
    """The plan as a recipe: QAT for ``epochs`` with each layer's weights at its chosen bits (weight-only, groups of
    ``group_size``) or float, a comment per layer."""
    total = sum(c.cost for c in choice.values())
    lines = [f"# Planned by recal: each layer's weight precision chosen to least {estimate} loss increase"
             + (f" under {budget:,.0f} bytes" if budget is not None else "") + f"; the plan holds {total:,.0f} bytes.",
             "# layer: bits (score: "
             + ("the loss increase measured with this layer alone quantized" if estimate == "measured"
                else f"the {estimate} estimate of the loss increase")
             + "; bytes)"]
    for layer in layers:
        c = choice[layer.name]
        held = "float" if c.bits == FLOAT else f"{c.bits} bits"
        lines.append(f"#   {layer.name}: {held} (score {c.score:.4g}, {c.cost:,.0f} bytes)")
    floats = [layer.name for layer in layers if choice[layer.name].bits == FLOAT]
    grouping = f"strategy: group, group_size: {group_size}" if group_size else "strategy: channel"
    lines += ["version: 1.0.0", "", "modifiers:",
              f"    - !EpochRangeModifier {{start_epoch: 0.0, end_epoch: {float(epochs)}}}",
              "", "    - !QuantizationModifier", "        start_epoch: 0.0",
              "        scheme:", "            input_activations: null",
              f"            weights: {{num_bits: 8, symmetric: true, {grouping}, observer: {observer}}}"]
    overrides = [layer.name for layer in layers if choice[layer.name].bits not in (8, FLOAT)]
    if overrides:
        lines.append("        scheme_overrides:")
        for name in overrides:
            bits = choice[name].bits
            lines.append(f"            {_quoted(name)}: {{input_activations: null, weights: {{num_bits: {bits}, "
                         f"symmetric: true, {grouping}, observer: {observer}}}}}")
    if floats:
        lines.append("        ignore: [" + ", ".join(_quoted(name) for name in floats) + "]")
    return "\n".join(lines) + "\n"


def _quoted(name: str) -> str:
    return "'" + name.replace("'", "''") + "'"
