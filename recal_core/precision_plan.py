"""A recipe planned from measurement: each layer's precision (and its channels' pruning) chosen under a budget,
written as a recipe.

A front end measures, per layer and per candidate, what the candidate costs (bytes; and, timed in onnxruntime on
this CPU by :func:`recal_onnx.timed_candidates`, milliseconds) and how much it hurts (a score: the loss increase
measured with that layer alone quantized, or a cheap estimate of it). A candidate is a precision (``"weight-only"``:
float, or weights in 8, 4 or 2 bits; ``"w8a8"``, a CNN's: int8 weights and inputs, or float) at one pruning level
of each channel space the layer makes or reads (a convolution reading one pruned space and making another pairs a
level of each: its cost is their product, so the pairs are candidates and the program stays linear).
:func:`solve` picks one candidate per layer minimising the summed score under a budget of bytes or milliseconds (or
the least cost under a summed-score budget), every layer of a space at one level, exactly, as an integer program
(``scipy.optimize.milp``: the knapsack is small, and the solver proves its answer optimal). A latency budget is the
planned layers' summed time, each layer timed alone: the rest of the model is the same in every plan.
:func:`recipe_text` writes the choice as an ordinary recipe: one ``QuantizationModifier`` (weight-only: its
``scheme_overrides`` name each layer's bits) whose ``ignore`` lists the float layers, a filter-pruning modifier per
level, a comment per layer with its score and cost. ``recal check`` reads it like any other; training it is the
usual loop.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from .errors import PlanError

FLOAT = 32  # a candidate's bits for "left float"
SEARCH_SECONDS = 120.0  # the integer program's time limit (a 99-layer plan with pruning: seconds)
PRUNE_SHARE = 0.5  # a planned pruning runs over the first half of the QAT epochs; the rest recovers
COSTS = ("bytes", "latency", "score")  # what a budget bounds: bytes, milliseconds, or the summed score
SCHEMES = ("weight-only", "w8a8")  # a plan's layers: weights alone at 8/4/2 bits, or weights and inputs in int8


@dataclass(frozen=True)
class Candidate:
    """One way to hold one layer: ``bits`` (32: float), its ``cost`` in bytes, its ``score`` (loss increase) and,
    once timed, its ``latency`` in milliseconds; with its pruning group's channels thinned by ``sparsity``, the
    ``kept`` channels."""

    bits: int
    cost: float
    score: float
    latency: float | None = None
    sparsity: float = 0.0  # the share of its pruning group's channels removed (its group's score shared in)
    kept: int | None = None  # then the channels it keeps along its pruned axis
    in_sparsity: float = 0.0  # a layer reading one group and making another: the share of the one it reads
    in_kept: int | None = None  # then the input channels it keeps


@dataclass(frozen=True)
class ConvGeometry:
    """What a convolution's time depends on beyond its channels: kernel, stride, padding, dilation, groups and
    the spatial size of one sample's input (``(H, W)``, or ``(L,)``)."""

    kernel: tuple[int, ...]
    stride: tuple[int, ...]
    padding: tuple[int, ...]
    dilation: tuple[int, ...]
    groups: int
    spatial: tuple[int, ...]

    def output(self) -> tuple[int, ...]:
        """The spatial size of its output."""
        sides = zip(self.spatial, self.kernel, self.stride, self.padding, self.dilation)
        return tuple((size + 2 * pad - dilation * (kernel - 1) - 1) // stride + 1
                     for size, kernel, stride, pad, dilation in sides)


@dataclass(frozen=True)
class LayerCandidates:
    """One layer's candidates, and its shape as a matmul (what a timer needs): ``rows`` of ``in_features`` in, for
    one sample of the calibration data, ``out_features`` out; a convolution (``in_features``, ``out_features``:
    its channels) also has its ``conv`` geometry. A layer in a pruning ``group`` (layers sharing one channel
    space: a gated MLP's gate, up and down projections; a convolution and the one reading its filters) thins its
    ``"outputs"`` (the group's producers, named in its pruning modifier), its ``"inputs"``, or both
    (``"through"``: a depthwise convolution between them); every layer of a group takes one sparsity. A layer
    making ``group``'s channels may read another's, ``in_group`` (a chain of convolutions): its candidates then
    pair a level of each."""

    name: str
    params: int
    candidates: tuple[Candidate, ...]
    in_features: int = 0
    out_features: int = 0
    rows: int = 1
    bias: bool = False
    group: str = ""
    pruned: str = ""  # "outputs" | "inputs" | "through" (in a group)
    in_group: str = ""  # with pruned "outputs": the group whose channels it reads
    conv: ConvGeometry | None = None
    scheme: str = "weight-only"  # or "w8a8": its inputs quantized with its weights (SCHEMES)

    def conv_groups(self, inputs: int) -> int:
        """Its convolution's groups at ``inputs`` channels: a depthwise convolution's thin with them."""
        return inputs if self.conv.groups == self.in_features else self.conv.groups

    def levels(self, c: Candidate) -> dict[str, float]:
        """``{group: sparsity}`` of each group ``c`` holds a level of."""
        return {**({self.group: c.sparsity} if self.group else {}),
                **({self.in_group: c.in_sparsity} if self.in_group else {})}


def matmul_shape(layer: LayerCandidates, candidate: Candidate) -> tuple[int, int, int]:
    """``(rows, inputs, outputs)`` of ``layer`` held as ``candidate``: thinned along its pruned axes (a
    convolution's: its input and output channels)."""
    k, n = layer.in_features, layer.out_features
    if candidate.kept is not None:
        k = candidate.kept if layer.pruned in ("inputs", "through") else k
        n = candidate.kept if layer.pruned in ("outputs", "through") else n
    if candidate.in_kept is not None:
        k = candidate.in_kept
    return layer.rows, k, n


def weight_count(layer: LayerCandidates, candidate: Candidate) -> int:
    """Weights of ``layer`` held as ``candidate`` (thinned as :func:`matmul_shape` thins): a Linear's inputs x
    outputs, a convolution's outputs x its filter's inputs x its kernel."""
    _, k, n = matmul_shape(layer, candidate)
    if layer.conv is None:
        return k * n
    return n * (k // layer.conv_groups(k)) * math.prod(layer.conv.kernel)


def macs(layer: LayerCandidates, candidate: Candidate) -> int:
    """Multiply-adds of ``layer`` held as ``candidate``, for one sample: each weight once a row (a Linear) or an
    output position (a convolution)."""
    uses = layer.rows if layer.conv is None else math.prod(layer.conv.output())
    return uses * weight_count(layer, candidate)


_UNIT = {"bytes": "bytes", "latency": "ms", "score": "of summed score"}


def _value(c: Candidate, cost: str) -> float:
    if cost == "bytes":
        return c.cost
    if cost == "score":
        return c.score
    if c.latency is None:
        raise PlanError("a latency budget needs each candidate timed: recal_onnx.timed_candidates(layers) times them "
                        "in onnxruntime on this CPU")
    return c.latency


def total(choice: dict[str, Candidate], cost: str = "bytes") -> float:
    """A plan's summed ``cost``: bytes, milliseconds (``"latency"``) or score."""
    return sum(_value(c, cost) for c in choice.values())


def size_bounds(layers: list[LayerCandidates], cost: str = "bytes") -> tuple[float, float]:
    """The summed ``cost`` of the cheapest plan (each layer at its cheapest candidate) and of the costliest."""
    return (sum(min(_value(c, cost) for c in layer.candidates) for layer in layers),
            sum(max(_value(c, cost) for c in layer.candidates) for layer in layers))


def _says(amount: float, cost: str) -> str:
    return f"{amount:,.0f} bytes" if cost == "bytes" else f"{amount:.4g} {_UNIT[cost]}"


def solve(layers: list[LayerCandidates], budget: float, cost: str = "bytes", *,
          within: Mapping[str, float] | None = None) -> dict[str, Candidate]:
    """One candidate per layer under a budget, exactly (an integer program): the least summed score with summed
    bytes or milliseconds (``cost="latency"``) <= ``budget``; or, with ``cost="score"``, the fewest bytes with
    summed score <= ``budget``. ``within`` adds caps on other costs (a latency budget within a size). A
    :class:`PlanError` names the nearest plan there is where none fits.

    Args:
        layers: each layer's candidates (latency: timed by :func:`recal_onnx.timed_candidates`).
        budget: the most the plan may cost, in the unit of ``cost``.
        cost: ``"bytes"``, ``"latency"`` or ``"score"``.
        within: more caps, ``{cost: most}`` (e.g. ``{"bytes": 2e6}`` beside a latency budget).
    """
    import numpy as np

    caps = {cost: budget, **(within or {})}
    for name in caps:
        if name not in COSTS:
            raise PlanError(f"cost must be one of {', '.join(COSTS)}, got {name!r}")
    for name, most in caps.items():
        least = size_bounds(layers, name)[0]
        if most < least - 1e-12:
            nearest = {"bytes": f"the smallest plan, every layer at its fewest bits, is {_says(least, name)}",
                       "latency": f"the fastest plan, every layer at its fastest candidate, takes {_says(least, name)}",
                       "score": f"the least summed score is {_says(least, name)}"}[name]
            raise PlanError(f"a {name} budget of {_says(most, name)} cannot be met: {nearest}; give at least that")
    flat = _flat(layers)
    # scores shifted to be >= 0 per layer (a candidate may measure below float by noise): the same argmin
    shift = np.array([min(c.score for c in layers[i].candidates) for i, _ in flat])
    objective = np.array([c.cost for _, c in flat]) if cost == "score" else np.array([c.score for _, c in flat]) - shift
    x = _milp(layers, flat, objective, caps)
    if x is None:  # each cap alone can be met, not all together: say the best the other caps leave for this one
        try:
            nearest = f"; within those, the least {cost} is {_says(total(cheapest(layers, cost, within), cost), cost)}"
        except PlanError:
            nearest = ""
        raise PlanError(f"no plan meets a {cost} budget of {_says(budget, cost)} together with "
                        + ", ".join(f"{k} <= {_says(v, k)}" for k, v in (within or {}).items()) + nearest)
    return {layers[flat[j][0]].name: flat[j][1] for j in x}


def cheapest(layers: list[LayerCandidates], cost: str = "latency",
             within: Mapping[str, float] | None = None) -> dict[str, Candidate]:
    """The plan of least summed ``cost`` (e.g. the fastest) within the caps ``within`` (e.g. ``{"bytes": 2e6}``),
    whatever its score: the near end of a budget's range. :class:`PlanError` where no plan meets the caps.

    Args:
        layers: each layer's candidates.
        cost: what to least: ``"bytes"``, ``"latency"`` or ``"score"``.
        within: caps on the other costs.
    """
    import numpy as np

    flat = _flat(layers)
    x = _milp(layers, flat, np.array([_value(c, cost) for _, c in flat]), dict(within or {}))
    if x is None:
        raise PlanError("no plan meets " + ", ".join(f"{k} <= {_says(v, k)}" for k, v in (within or {}).items()))
    return {layers[flat[j][0]].name: flat[j][1] for j in x}


def _flat(layers: list[LayerCandidates]) -> list[tuple[int, Candidate]]:
    """Every candidate with its layer's index: the integer program's columns."""
    return [(i, c) for i, layer in enumerate(layers) for c in layer.candidates]


def _milp(layers, flat, objective, caps: Mapping[str, float]):
    """The chosen candidates' indices into ``flat`` minimising ``objective``, one per layer, under ``caps``; None
    where no plan meets them."""
    import numpy as np
    from scipy.optimize import Bounds, LinearConstraint, milp

    one_each = np.zeros((len(layers), len(flat)))
    for j, (i, _) in enumerate(flat):
        one_each[i, j] = 1.0
    lines = [LinearConstraint(one_each, 1, 1)]
    same = _one_sparsity_a_group(layers, flat)
    if len(same):
        lines.append(LinearConstraint(same, 0, 0))
    lines += [
        LinearConstraint(np.array([_value(c, name) for _, c in flat])[None, :], -np.inf, most)
        for name, most in caps.items()]
    result = milp(objective, integrality=np.ones(len(flat)), bounds=Bounds(0, 1), constraints=lines,
                  options={"mip_rel_gap": 0.0, "time_limit": SEARCH_SECONDS})  # proven optimal, not within 0.01%
    if not result.success and result.status == 1 and result.x is not None:  # the time limit, a plan in hand
        import warnings

        warnings.warn(f"the plan search stopped at its {SEARCH_SECONDS:.0f} s limit before proving its plan the best; "
                      f"the plan written is the best it found (within {getattr(result, 'mip_gap', float('nan')):.2%} "
                      "of the best by the solver's bound)", RuntimeWarning, stacklevel=4)
        return np.flatnonzero(result.x > 0.5)
    if result.status == 1:
        raise PlanError(f"the plan search found no plan within its {SEARCH_SECONDS:.0f} s limit: {result.message}")
    return np.flatnonzero(result.x > 0.5) if result.success else None


def _one_sparsity_a_group(layers, flat):
    """Rows saying each layer of a pruning group takes the sparsity its first layer takes (a layer in two groups,
    the one it reads and the one it makes, once for each)."""
    import numpy as np

    first: dict[str, int] = {}
    rows = []
    for i, layer in enumerate(layers):
        for group in filter(None, (layer.group, layer.in_group)):
            lead = first.setdefault(group, i)
            if lead == i:
                continue
            held = {layers[lead].levels(c)[group] for c in layers[lead].candidates}
            for level in held | {layer.levels(c)[group] for c in layer.candidates}:
                row = np.zeros(len(flat))
                for j, (k, c) in enumerate(flat):
                    if k in (i, lead) and layers[k].levels(c)[group] == level:
                        row[j] = 1.0 if k == i else -1.0
                rows.append(row)
    return np.array(rows)


def pareto(layers: list[LayerCandidates], points: int = 12, cost: str = "bytes",
           within: Mapping[str, float] | None = None) -> list[tuple[float, float, dict[str, Candidate]]]:
    """``(cost, score, choice)`` of the best plan at ``points`` budgets spread from the cheapest plan to the
    costliest, in bytes or milliseconds (``cost="latency"``), under the caps ``within``: the curve a budget is
    chosen on (budgets no plan meets within those caps left out)."""
    low, high = size_bounds(layers, cost)
    curve = []
    for k in range(points):
        try:
            choice = solve(layers, low + (high - low) * k / max(1, points - 1), cost, within=within)
        except PlanError:
            continue
        point = (total(choice, cost), total(choice, "score"), choice)
        if not curve or point[:2] != curve[-1][:2]:  # a larger budget the best plan does not use: one point
            curve.append(point)
    return curve


def recipe_text(layers: list[LayerCandidates], choice: dict[str, Candidate], *, group_size: int = 32,
                observer: str = "mse", epochs: float = 1.0, budget: float | None = None,
                estimate: str = "measured", cost: str = "bytes", within: Mapping[str, float] | None = None,
                scheme: str | None = None) -> str:
    """The plan as a recipe: QAT for ``epochs`` with each layer's weights at its chosen bits (weight-only, groups of
    ``group_size``; or, ``scheme="w8a8"``, weights and inputs in int8, the default scheme) or float, each pruning
    group's channels pruned (``mask_type: filter`` on its producers, over the first half of the epochs) to its
    sparsity, a comment per layer with its score, bytes and (when timed) milliseconds.

    Args:
        layers: each layer's candidates.
        choice: the candidate chosen for each layer (:func:`solve`).
        group_size: weights per scale (0: one per output channel).
        observer: the weights' observer in the recipe.
        epochs: the QAT epochs the recipe schedules.
        budget: the budget the plan was solved under, for the header.
        estimate: how the scores were had (``"measured"`` or ``"fisher"``).
        cost: the unit of ``budget`` (``"bytes"``, ``"latency"``, ``"score"``).
        within: the other caps the plan was solved under.
        scheme: ``"weight-only"`` (the chosen bits on weights alone) or ``"w8a8"`` (each layer's weights and inputs
            in int8, or float); None: the layers' own.
    """
    scheme = scheme or (layers[0].scheme if layers else "weight-only")
    if scheme not in SCHEMES:
        raise PlanError(f"scheme must be one of {', '.join(SCHEMES)}, got {scheme!r}")
    timed = all(c.latency is not None for c in choice.values())
    under = "" if budget is None else f" under {_says(budget, cost)}" if cost != "score" else ""
    under += "".join(f" within {_says(most, name)}" for name, most in (within or {}).items())
    aim = (f"least {estimate} loss increase{under}" if cost != "score"
           else f"fewest bytes at a summed {estimate} loss increase of at most {budget:.4g}")
    what = "weight precision" if scheme == "weight-only" else "int8 or float (weights and inputs)"
    what += " and pruning" if any(c.sparsity or c.in_sparsity for c in choice.values()) else ""
    lines = [f"# Planned by recal: each layer's {what} chosen to {aim}; the plan holds "
             f"{total(choice):,.0f} bytes" + (f" and its layers take {total(choice, 'latency'):.4g} ms, each timed "
                                              "alone in onnxruntime on this CPU" if timed else "") + ".",
             "# layer: bits (score: "
             + ("the loss increase measured with this layer alone quantized" if estimate == "measured"
                else f"the {estimate} estimate of the loss increase")
             + "; bytes; multiply-adds a sample" + ("; ms" if timed else "") + ")"]
    for layer in layers:
        c = choice[layer.name]
        grid = "int8" + (", 7-bit weights" if c.bits == 7 else "") if scheme == "w8a8" else f"{c.bits} bits"
        held = ("float" if c.bits == FLOAT else grid) + (
            f", {c.sparsity:.0%} of its {layer.pruned} pruned ({c.kept} kept)" if c.sparsity else "") + (
            f", {c.in_sparsity:.0%} of its inputs pruned ({c.in_kept} kept)" if c.in_sparsity else "")
        lines.append(f"#   {layer.name}: {held} (score {c.score:.4g}, {c.cost:,.0f} bytes, "
                     f"{macs(layer, c) / 1e6:.4g} M multiply-adds" + (f", {c.latency:.4g} ms" if timed else "") + ")")
    floats = [layer.name for layer in layers if choice[layer.name].bits == FLOAT]
    grouping = f"strategy: group, group_size: {group_size}" if group_size else "strategy: channel"
    lines += ["version: 1.0.0", "", "modifiers:",
              f"    - !EpochRangeModifier {{start_epoch: 0.0, end_epoch: {float(epochs)}}}",
              "", "    - !QuantizationModifier", "        start_epoch: 0.0"]
    if scheme == "weight-only":
        lines += ["        scheme:", "            input_activations: null",
                  f"            weights: {{num_bits: 8, symmetric: true, {grouping}, observer: {observer}}}"]
    overrides = [layer.name for layer in layers if choice[layer.name].bits not in (8, FLOAT)]
    if scheme == "w8a8":  # one grid for every int8 layer: 8-bit weights, or 7-bit (reduce_range) in all of them
        held = {c.bits for c in choice.values()} - {FLOAT}
        if held not in (set(), {8}, {7}):
            raise PlanError(f"{overrides[0]}: {choice[overrides[0]].bits} bits in a w8a8 plan, whose layers are int8 "
                            "(8-bit weights, or 7-bit in every layer) or float")
        lines += ["        reduce_range: true"] if held == {7} else []
        overrides = []
    if overrides:
        lines.append("        scheme_overrides:")
        for name in overrides:
            bits = choice[name].bits
            lines.append(f"            {_quoted(name)}: {{input_activations: null, weights: {{num_bits: {bits}, "
                         f"symmetric: true, {grouping}, observer: {observer}}}}}")
    if floats:
        lines.append("        ignore: [" + ", ".join(_quoted(name) for name in floats) + "]")
    by_level: dict[float, list[str]] = {}
    for layer in layers:  # a group's producers name its channels: one modifier for the groups of one sparsity
        if layer.pruned == "outputs" and choice[layer.name].sparsity:
            by_level.setdefault(choice[layer.name].sparsity, []).append(f"{layer.name}.weight")
    end = float(epochs) * PRUNE_SHARE
    for level, weights in sorted(by_level.items()):
        lines += ["", "    - !GradualKSModifier",
                  "        params: [" + ", ".join(_quoted(w) for w in weights) + "]",
                  f"        init_sparsity: 0.0\n        final_sparsity: {level}",
                  f"        start_epoch: 0.0\n        end_epoch: {end}\n        update_frequency: {end / 10}",
                  "        mask_type: filter"]
    return "\n".join(lines) + "\n"


def _quoted(name: str) -> str:
    return "'" + name.replace("'", "''") + "'"
