"""PyTorch's measurements for a planned recipe (:mod:`recal_core.precision_plan`): per Linear layer and per weight
precision (8, 4, 2 bits, weight-only, in groups), its cost in bytes and its score, the loss increase.

Two scores, compared in docs/pytorch.md:

- ``"measured"``: the loss on the calibration batches with that layer's weights alone on the candidate's grid
  (recal's own quantizer, as QAT starts from it), minus the float loss. One forward per layer, candidate and batch.
- ``"fisher"``: a cheap estimate, as ModelOpt's ``auto_quantize`` scores: ``1/2 * sum(g**2 * dy**2)`` over the
  layer's output, ``dy`` the change the candidate's weights make to it and ``g`` each output row's own loss gradient
  (the loss's gradient times the rows it averages over: an output row belongs to one sample or token, so this is
  the empirical Fisher, not the square of a batch's mean gradient, which vanishes at a minimum). One forward and
  backward per batch in all.

Each layer also carries its shape as a matmul (inputs, outputs, and the rows one calibration sample feeds it), so
a timer (:func:`recal_onnx.timed_candidates`) can time its candidates in onnxruntime for a latency budget.

Only ``nn.Linear`` (and recal's QAT Linear) layers are candidates: the weight-only grid onnxruntime runs
(``MatMulNBits``) is a matmul's. Convolutions and embeddings are left out, named in :attr:`PrecisionPlan.left_out`.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
from torch import nn

from recal_core.precision_plan import FLOAT, Candidate, LayerCandidates, pareto, recipe_text, solve, total

from .pruning_plan import group_scores, plan_groups
from .qat import GroupWeightFakeQuantize

BITS = (8, 4, 2)
SCALE_BYTES = 4  # a group's float32 scale
UNPRUNED = {0.0: (None, 0.0)}  # a layer's one pruning level outside a group: (channels kept, its score share)


@dataclass
class PrecisionPlan:
    layers: list[LayerCandidates]
    choice: dict
    recipe: str
    curve: list = field(default_factory=list)  # (bytes or ms, summed score) of the best plan at budgets across them
    left_out: dict[str, str] = field(default_factory=dict)  # layer -> why it is not planned
    cost: str = "bytes"  # what the budget counts: "bytes", "latency" (ms; the curve's axis too) or "score"

    @property
    def size(self) -> float:
        return total(self.choice)

    @property
    def latency(self) -> float | None:
        """The planned layers' summed milliseconds, each timed alone (None: not timed)."""
        return None if any(c.latency is None for c in self.choice.values()) else total(self.choice, "latency")


def _cost(layer: nn.Linear, bits: int, group_size: int, k: int | None = None, n: int | None = None) -> float:
    """Bytes of ``layer`` held at ``bits``, thinned to ``k`` inputs and ``n`` outputs when given."""
    k, n = k or layer.in_features, n or layer.out_features
    weights = k * n
    bias = 4 * n if layer.bias is not None else 0
    if bits == FLOAT:
        return 4.0 * weights + bias
    groups = weights // group_size if group_size else n
    return weights * bits / 8 + groups * SCALE_BYTES + bias


def measure_precision(model: nn.Module, batches: Iterable, loss_fn: Callable[[nn.Module, object], torch.Tensor], *,
                      score: str = "measured", bits: tuple[int, ...] = BITS, group_size: int = 32,
                      prune_levels: tuple[float, ...] = (),
                      progress: bool = False) -> tuple[list[LayerCandidates], dict[str, str]]:
    """Every Linear layer's candidates (float and ``bits``) with costs and scores on ``batches``, and the layers
    left out with why: what :func:`plan_precision` solves over, for a caller that solves several budgets itself
    (:func:`recal_core.precision_plan.solve`). ``model`` is left as it was.

    Args:
        model: the float model.
        batches: calibration batches.
        loss_fn: ``loss_fn(model, batch)``, the loss of one batch.
        score: ``"measured"`` (each candidate's loss increase, measured) or ``"fisher"`` (estimated).
        bits: the weight bit widths to score.
        group_size: the weights' group size (a layer whose inputs do not split into groups is left out).
        prune_levels: shares of a channel space's channels its layers may be pruned by (e.g. ``(0.25, 0.5)``),
            planned with the precision (:mod:`recal_torch.pruning_plan`); each level's score, the loss increase
            with the space alone pruned, is measured with either ``score``.
        progress: show a progress bar.
    """
    if score not in ("measured", "fisher"):
        raise ValueError(f"score must be 'measured' or 'fisher', got {score!r}")
    if not all(0 < level < 1 for level in prune_levels):
        raise ValueError(f"prune_levels {tuple(prune_levels)}: each a share of the channels, above 0 and below 1")
    batches = list(batches)
    if not batches:
        raise ValueError("planning needs at least one calibration batch")
    linears, left_out = {}, {}
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            if group_size and module.in_features % group_size:
                left_out[name] = f"its {module.in_features} inputs do not split into groups of {group_size}"
            else:
                linears[name] = module
        elif isinstance(module, (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.Embedding)):
            left_out[name] = f"a {type(module).__name__}: weight-only grids are planned for Linear layers only"
    was_training = model.training
    model.eval()
    try:
        rows, example, first = _rows_per_sample(model, linears, batches[0], loss_fn)
        with torch.no_grad():
            base = (first + sum(float(loss_fn(model, b)) for b in batches[1:])) / len(batches)
        shares = _pruning(model, linears, example, tuple(prune_levels), group_size, batches, loss_fn, base)
        grids = {name: {b: _quantized(layer.weight, b, group_size) for b in bits} for name, layer in linears.items()}
        if score == "fisher":
            estimates = _output_fisher(model, linears, grids, batches, loss_fn)
        layers = []
        items = linears.items()
        if progress:
            from tqdm import tqdm

            items = tqdm(items, desc="planning", unit="layer")
        for name, layer in items:
            quantized = {FLOAT: 0.0}
            for b in bits:
                quantized[b] = (_measured(model, layer, grids[name][b], batches, loss_fn) - base if score == "measured"
                                else estimates[name, b])
            group, along, levels = shares.get(name, ("", "", UNPRUNED))
            candidates = []
            for level, (kept, share) in levels.items():
                k, n = (None, kept) if along == "outputs" else (kept, None)
                candidates += [Candidate(b, _cost(layer, b, group_size, k, n), value + share, sparsity=level, kept=kept)
                               for b, value in quantized.items()]
            layers.append(LayerCandidates(name, layer.weight.numel(), tuple(candidates), layer.in_features,
                                          layer.out_features, rows.get(name, 1), layer.bias is not None, group, along))
    finally:
        model.train(was_training)
    return layers, left_out


def _pruning(model, linears, example, levels, group_size, batches, loss_fn, base) -> dict[str, tuple]:
    """Each pruned layer's ``(group, "outputs" | "inputs", {level: (channels kept, its share of the group's
    score)})``, level 0 included (:mod:`recal_torch.pruning_plan`); a warning where no space can be pruned."""
    if not levels:
        return {}
    groups, why = plan_groups(model, linears, example, group_size)
    if not groups:
        warnings.warn(f"prune_levels {levels}: nothing is pruned: {why}; the plan is precision only", stacklevel=4)
    shares = {}
    for group in groups:
        scores = group_scores(model, group, linears, levels, batches, loss_fn, base)
        members = group.producers + group.readers
        by_level = UNPRUNED | {level: (group.channels - group.pruned(level), scores[level] / len(members))
                               for level in levels if 0 < group.pruned(level) < group.channels}
        for name in members:
            shares[name] = (group.name, "outputs" if name in group.producers else "inputs", by_level)
    return shares


def _leading(batch) -> int | None:
    """The batch's sample count: the first dimension of its first tensor."""
    if isinstance(batch, torch.Tensor):
        return batch.shape[0] if batch.dim() else None
    items = batch.values() if isinstance(batch, dict) else batch if isinstance(batch, (list, tuple)) else ()
    return next((n for n in map(_leading, items) if n), None)


def _rows_per_sample(model, linears: dict[str, nn.Linear], batch, loss_fn) -> tuple[dict[str, int], tuple, float]:
    """Each layer's input rows for one sample of ``batch`` (tokens of a sequence, 1 for a vector): the matmul a
    latency timer times; the model's own call on ``batch``, ``(args, kwargs)``, to trace its channels with; and
    the batch's loss (the float loss's first term)."""
    seen, samples, call = {}, _leading(batch) or 1, []

    def keep(name):
        def hook(module, args):
            seen.setdefault(name, max(1, args[0].numel() // args[0].shape[-1] // samples))
        return hook

    hooks = [layer.register_forward_pre_hook(keep(name)) for name, layer in linears.items()]
    hooks.append(model.register_forward_pre_hook(lambda m, args, kwargs: call.append((args, kwargs)) if not call
                                                 else None, with_kwargs=True))
    try:
        with torch.no_grad():
            loss = float(loss_fn(model, batch))
    finally:
        for h in hooks:
            h.remove()
    return seen, (call[0] if call else ((), {})), loss


def _quantized(weight: torch.Tensor, bits: int, group_size: int) -> torch.Tensor:
    quantizer = GroupWeightFakeQuantize(weight.shape[0], weight.shape[1], bits, group_size or None, observer="mse")
    with torch.no_grad():
        return quantizer(weight.detach()).detach()


def _measured(model, layer: nn.Linear, quantized: torch.Tensor, batches, loss_fn) -> float:
    original = layer.weight.detach().clone()
    try:
        with torch.no_grad():
            layer.weight.copy_(quantized)
            return sum(float(loss_fn(model, b)) for b in batches) / len(batches)
    finally:
        with torch.no_grad():
            layer.weight.copy_(original)


def _output_fisher(model, linears: dict[str, nn.Linear], grids, batches, loss_fn) -> dict[tuple[str, int], float]:
    """The ``"fisher"`` score of every layer and candidate (module docstring), averaged over ``batches``."""
    scores = {(name, b): 0.0 for name, by_bits in grids.items() for b in by_bits}
    for batch in batches:
        inputs, grads, hooks = {}, {}, []

        def keep(name):
            def hook(module, args, output):
                inputs[name] = args[0].detach()
                output.register_hook(lambda g: grads.__setitem__(name, g.detach()))
            return hook

        hooks = [layer.register_forward_hook(keep(name)) for name, layer in linears.items()]
        try:
            model.zero_grad(set_to_none=True)
            loss_fn(model, batch).backward()
        finally:
            for h in hooks:
                h.remove()
        with torch.no_grad():
            for name, layer in linears.items():
                if name not in grads:
                    continue  # not on the loss's path for this batch
                g, rows = grads[name], grads[name].numel() // grads[name].shape[-1]
                for b, quantized in grids[name].items():
                    dy = nn.functional.linear(inputs[name], quantized - layer.weight)
                    scores[name, b] += 0.5 * rows * float((g ** 2 * dy ** 2).sum()) / len(batches)
    model.zero_grad(set_to_none=True)
    return scores


def plan_precision(model: nn.Module, batches: Iterable, loss_fn: Callable[[nn.Module, object], torch.Tensor], *,
                   budget: float | None = None, bits_budget: float | None = None,
                   latency_budget: float | None = None, loss_budget: float | None = None,
                   timer: Callable | None = None, score: str = "measured", group_size: int = 32,
                   prune_levels: tuple[float, ...] = (), epochs: float = 1.0, progress: bool = False) -> PrecisionPlan:
    """Measure, then choose each Linear's weight precision under ``budget`` bytes (or ``bits_budget`` bits per
    weight on average, counting its scales; or ``latency_budget`` milliseconds, the planned layers timed in
    onnxruntime by ``timer``; or the fewest bytes within ``loss_budget`` of summed score), and write the recipe.

    Args:
        model: the trained float model; measured in eval mode and left as it was.
        batches: the calibration batches, each passed to ``loss_fn`` as it is.
        loss_fn: ``loss_fn(model, batch)``, the loss of one batch (a mean over its rows).
        budget: the plan's bytes at most: weights, their scales and the biases of the planned layers.
        bits_budget: instead, bits per weight on average (scales counted, biases apart).
        latency_budget: instead, the planned layers' summed milliseconds at most, each layer timed alone at one
            sample's rows; with ``budget`` or ``bits_budget`` too, within that size.
        loss_budget: instead, the summed score (loss increase) at most: the smallest plan within it.
        timer: what times the candidates for ``latency_budget``: :func:`recal_onnx.timed_candidates` (or a
            function of the same form, ``timer(layers, group_size=...)``; recal_torch does not import recal_onnx).
        score: ``"measured"`` (each layer alone quantized, the loss increase) or ``"fisher"`` (the estimate).
        group_size: weights per scale along a layer's inputs (0: one scale per output channel).
        prune_levels: shares of each prunable channel space (a gated MLP's hidden channels) its layers may be
            pruned by, planned with the precision (:func:`measure_precision`); the recipe prunes them
            (``mask_type: filter``) over the first half of the epochs.
        epochs: the QAT epochs the recipe schedules.
        progress: a progress bar over the layers.

    >>> import torch
    >>> net = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    >>> data = [(torch.randn(8, 64), torch.randint(0, 4, (8,)))]
    >>> loss = lambda m, b: torch.nn.functional.cross_entropy(m(b[0]), b[1])
    >>> plan = plan_precision(net, data, loss, bits_budget=5.0)
    >>> plan.recipe.count("!QuantizationModifier")
    1
    """
    if budget is not None and bits_budget is not None:
        raise ValueError("give budget (bytes) or bits_budget (bits per weight), not both")
    sized = budget is not None or bits_budget is not None
    if loss_budget is not None and (sized or latency_budget is not None):
        raise ValueError("loss_budget plans the fewest bytes within a summed score: it takes no other budget")
    if not sized and latency_budget is None and loss_budget is None:
        raise ValueError("give a budget: budget (bytes), bits_budget (bits per weight), latency_budget (ms, alone "
                         "or with a size) or loss_budget (summed score)")
    if latency_budget is not None and timer is None:
        raise ValueError("latency_budget needs timer=recal_onnx.timed_candidates: the layers are timed in "
                         "onnxruntime on this CPU")
    layers, left_out = measure_precision(model, batches, loss_fn, score=score, group_size=group_size,
                                         prune_levels=prune_levels, progress=progress)
    if not layers:
        raise ValueError("no Linear layer to plan: " + "; ".join(f"{k}: {v}" for k, v in left_out.items()))
    cost, within = "bytes", {}
    if bits_budget is not None:
        biases = sum(next(c.cost for c in layer.candidates if c.bits == FLOAT) - FLOAT / 8 * layer.params
                     for layer in layers)  # what a float layer holds beyond its weights
        budget = bits_budget / 8 * sum(layer.params for layer in layers) + biases
    if latency_budget is not None:
        layers = timer(layers, group_size=group_size, progress=progress)
        within = {} if budget is None else {"bytes": budget}
        budget, cost = latency_budget, "latency"
    if loss_budget is not None:
        budget, cost = loss_budget, "score"
    choice = solve(layers, budget, cost, within=within)
    curve = [(spent, summed) for spent, summed, _ in pareto(layers, cost="bytes" if cost == "score" else cost,
                                                            within=within)]
    text = recipe_text(layers, choice, group_size=group_size, epochs=epochs, budget=budget, estimate=score, cost=cost,
                       within=within)
    return PrecisionPlan(layers, choice, text, curve, left_out, cost)
