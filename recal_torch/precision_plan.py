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

Only ``nn.Linear`` (and recal's QAT Linear) layers are candidates: the weight-only grid onnxruntime runs
(``MatMulNBits``) is a matmul's. Convolutions and embeddings are left out, named in :attr:`PrecisionPlan.left_out`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
from torch import nn

from recal_core.precision_plan import FLOAT, Candidate, LayerCandidates, pareto, recipe_text, solve

from .qat import GroupWeightFakeQuantize

BITS = (8, 4, 2)
SCALE_BYTES = 4  # a group's float32 scale


@dataclass
class PrecisionPlan:
    layers: list[LayerCandidates]
    choice: dict
    recipe: str
    curve: list = field(default_factory=list)  # (bytes, summed score) of the best plan at budgets across the range
    left_out: dict[str, str] = field(default_factory=dict)  # layer -> why it is not planned

    @property
    def size(self) -> float:
        return sum(c.cost for c in self.choice.values())


def _cost(layer: nn.Linear, bits: int, group_size: int) -> float:
    weights = layer.weight.numel()
    bias = 4 * layer.bias.numel() if layer.bias is not None else 0
    if bits == FLOAT:
        return 4.0 * weights + bias
    groups = weights // group_size if group_size else layer.weight.shape[0]
    return weights * bits / 8 + groups * SCALE_BYTES + bias


def measure_precision(model: nn.Module, batches: Iterable, loss_fn: Callable[[nn.Module, object], torch.Tensor], *,
                      score: str = "measured", bits: tuple[int, ...] = BITS, group_size: int = 32,
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
        progress: show a progress bar.
    """
    if score not in ("measured", "fisher"):
        raise ValueError(f"score must be 'measured' or 'fisher', got {score!r}")
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
        with torch.no_grad():
            base = sum(float(loss_fn(model, b)) for b in batches) / len(batches)
        grids = {name: {b: _quantized(layer.weight, b, group_size) for b in bits} for name, layer in linears.items()}
        if score == "fisher":
            estimates = _output_fisher(model, linears, grids, batches, loss_fn)
        layers = []
        items = linears.items()
        if progress:
            from tqdm import tqdm

            items = tqdm(items, desc="planning", unit="layer")
        for name, layer in items:
            candidates = [Candidate(FLOAT, _cost(layer, FLOAT, group_size), 0.0)]
            for b in bits:
                if score == "measured":
                    value = _measured(model, layer, grids[name][b], batches, loss_fn) - base
                else:
                    value = estimates[name, b]
                candidates.append(Candidate(b, _cost(layer, b, group_size), value))
            layers.append(LayerCandidates(name, layer.weight.numel(), tuple(candidates)))
    finally:
        model.train(was_training)
    return layers, left_out


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
                   budget: float | None = None, bits_budget: float | None = None, score: str = "measured",
                   group_size: int = 32, epochs: float = 1.0, progress: bool = False) -> PrecisionPlan:
    """Measure, then choose each Linear's weight precision under ``budget`` bytes (or ``bits_budget`` bits per
    weight on average, counting its scales), and write the recipe.

    Args:
        model: the trained float model; measured in eval mode and left as it was.
        batches: the calibration batches, each passed to ``loss_fn`` as it is.
        loss_fn: ``loss_fn(model, batch)``, the loss of one batch (a mean over its rows).
        budget: the plan's bytes at most: weights, their scales and the biases of the planned layers.
        bits_budget: instead, bits per weight on average (scales counted, biases apart).
        score: ``"measured"`` (each layer alone quantized, the loss increase) or ``"fisher"`` (the estimate).
        group_size: weights per scale along a layer's inputs (0: one scale per output channel).
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
    if (budget is None) == (bits_budget is None):
        raise ValueError("give one budget: budget (bytes) or bits_budget (bits per weight)")
    layers, left_out = measure_precision(model, batches, loss_fn, score=score, group_size=group_size, progress=progress)
    if not layers:
        raise ValueError("no Linear layer to plan: " + "; ".join(f"{k}: {v}" for k, v in left_out.items()))
    if bits_budget is not None:
        biases = sum(next(c.cost for c in layer.candidates if c.bits == FLOAT) - FLOAT / 8 * layer.params
                     for layer in layers)  # what a float layer holds beyond its weights
        budget = bits_budget / 8 * sum(layer.params for layer in layers) + biases
    choice = solve(layers, budget)
    curve = [(cost, total) for cost, total, _ in pareto(layers)]
    text = recipe_text(layers, choice, group_size=group_size, epochs=epochs, budget=budget, estimate=score)
    return PrecisionPlan(layers, choice, text, curve, left_out)
