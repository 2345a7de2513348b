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

Under the default ``scheme="weight-only"`` only ``nn.Linear`` (and recal's QAT Linear) layers are candidates: the
weight-only grid onnxruntime runs (``MatMulNBits``) is a matmul's. ``scheme="w8a8"`` plans a CNN instead: each
Conv1d, Conv2d and Linear in int8 (weights and input, :mod:`recal_torch.int8_plan`) or float, its convolutions'
filters pruned with it (``prune_levels``). What is left out is named in :attr:`PrecisionPlan.left_out`.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
from torch import nn

from recal_core.precision_plan import (FLOAT, SCHEMES, Candidate, LayerCandidates, macs, matmul_shape, pareto,
                                      recipe_text, solve, total, weight_count)

from .int8_plan import geometry, input_spans, int8_input, int8_weight, is_planned_conv, measured_int8, output_of
from .pruning_plan import group_scores, plan_groups
from .qat import GroupWeightFakeQuantize

BITS = (8, 4, 2)
SCALE_BYTES = 4  # a group's (or a channel's) float32 scale
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
    def macs(self) -> int:
        """The planned layers' multiply-adds for one sample."""
        return sum(macs(layer, self.choice[layer.name]) for layer in self.layers)

    @property
    def latency(self) -> float | None:
        """The planned layers' summed milliseconds, each timed alone (None: not timed)."""
        return None if any(c.latency is None for c in self.choice.values()) else total(self.choice, "latency")


def _bytes(layer: LayerCandidates, c: Candidate, group_size: int) -> float:
    """Bytes of ``layer`` held as ``c``: its weights (thinned as ``c`` thins them) at ``c``'s bits with their scales
    (one a group of ``group_size``, or a channel), its bias in float32 (int32 under ``w8a8``: as many bytes)."""
    _, _, n = matmul_shape(layer, c)
    weights = weight_count(layer, c)
    bias = 4 * n if layer.bias else 0
    if c.bits == FLOAT:
        return 4.0 * weights + bias
    groups = weights // group_size if group_size else n
    stored = 8 if layer.scheme == "w8a8" else c.bits  # 7-bit weights (reduce_range) are held as int8
    return weights * stored / 8 + groups * SCALE_BYTES + bias


def measure_precision(model: nn.Module, batches: Iterable, loss_fn: Callable[[nn.Module, object], torch.Tensor], *,
                      score: str = "measured", bits: tuple[int, ...] | None = None, group_size: int = 32,
                      prune_levels: tuple[float, ...] = (), scheme: str = "weight-only",
                      progress: bool = False) -> tuple[list[LayerCandidates], dict[str, str]]:
    """Every planned layer's candidates (float and ``bits``) with costs and scores on ``batches``, and the layers
    left out with why: what :func:`plan_precision` solves over, for a caller that solves several budgets itself
    (:func:`recal_core.precision_plan.solve`). ``model`` is left as it was.

    Args:
        model: the float model.
        batches: calibration batches.
        loss_fn: ``loss_fn(model, batch)``, the loss of one batch.
        score: ``"measured"`` (each candidate's loss increase, measured) or ``"fisher"`` (estimated).
        bits: the weight bit widths to score (None: 8, 4 and 2 weight-only; 8 under ``"w8a8"``, or ``(7,)``: 7-bit
            weights, ``reduce_range``, the AVX2 twin's grid, which is the whole model's or none).
        group_size: the weights' group size (a layer whose inputs do not split into groups is left out).
        prune_levels: shares of a channel space's channels its layers may be pruned by (e.g. ``(0.25, 0.5)``),
            planned with the precision (:mod:`recal_torch.pruning_plan`); each level's score, the loss increase
            with the space alone pruned, is measured with either ``score``.
        scheme: ``"weight-only"`` (Linear layers, weights alone at ``bits``) or ``"w8a8"`` (Conv1d, Conv2d and
            Linear layers, int8 weights and inputs or float: a CNN's plan, :mod:`recal_torch.int8_plan`).
        progress: show a progress bar.
    """
    if score not in ("measured", "fisher"):
        raise ValueError(f"score must be 'measured' or 'fisher', got {score!r}")
    if scheme not in SCHEMES:
        raise ValueError(f"scheme must be one of {', '.join(SCHEMES)}, got {scheme!r}")
    int8 = scheme == "w8a8"
    bits = tuple(bits or ((8,) if int8 else BITS))
    if int8 and bits not in ((8,), (7,)):
        raise ValueError(f"bits {bits}: a w8a8 plan holds each layer in int8 or float: bits=(8,), or (7,) for 7-bit "
                         "weights (reduce_range: exact on every x86 CPU, with or without VNNI)")
    if not all(0 < level < 1 for level in prune_levels):
        raise ValueError(f"prune_levels {tuple(prune_levels)}: each a share of the channels, above 0 and below 1")
    batches = list(batches)
    if not batches:
        raise ValueError("planning needs at least one calibration batch")
    group_size = 0 if int8 else group_size
    linears, left_out = _planned(model, group_size, int8)
    was_training = model.training
    model.eval()
    try:
        rows, example, first, spatial = _rows_per_sample(model, linears, batches[0], loss_fn)
        with torch.no_grad():
            base = (first + sum(float(loss_fn(model, b)) for b in batches[1:])) / len(batches)
        shares = _pruning(model, linears, example, tuple(prune_levels), group_size, batches, loss_fn, base)
        spans = input_spans(model, linears, batches, loss_fn) if int8 and score == "fisher" else {}
        grids = {name: ({b: int8_weight(layer.weight, b == 7) for b in bits} if int8 else
                        {b: _quantized(layer.weight, b, group_size) for b in bits}) for name, layer in linears.items()}
        if score == "fisher":
            estimates = _output_fisher(model, linears, grids, spans, batches, loss_fn)
        layers = []
        items = linears.items()
        if progress:
            from tqdm import tqdm

            items = tqdm(items, desc="planning", unit="layer")
        for name, layer in items:
            quantized = {FLOAT: 0.0}
            for b in bits:
                if score == "fisher":
                    quantized[b] = estimates[name, b]
                elif int8:
                    quantized[b] = measured_int8(model, name, batches, loss_fn, reduce_range=b == 7) - base
                else:
                    quantized[b] = _measured(model, layer, grids[name][b], batches, loss_fn) - base
            layers.append(_candidates(name, layer, quantized, shares.get(name, []), group_size, int8,
                                      rows.get(name, 1), spatial.get(name)))
    finally:
        model.train(was_training)
    return layers, left_out


def _planned(model: nn.Module, group_size: int, int8: bool) -> tuple[dict[str, nn.Module], dict[str, str]]:
    """The layers a plan chooses for, and those it leaves out with why."""
    planned, left_out = {}, {}
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) or (int8 and is_planned_conv(module)):
            if group_size and module.in_features % group_size:
                left_out[name] = f"its {module.in_features} inputs do not split into groups of {group_size}"
            else:
                planned[name] = module
        elif isinstance(module, (nn.Conv1d, nn.Conv2d, nn.Conv3d)):
            left_out[name] = (f"a {type(module).__name__}: weight-only grids are planned for Linear layers only; "
                              "scheme='w8a8' plans int8 or float for convolutions" if not int8 else
                              f"a {type(module).__name__}: 1-D and 2-D convolutions with zero padding are planned")
        elif isinstance(module, nn.Embedding):
            left_out[name] = "an Embedding: tables are not planned"
    return planned, left_out


def _candidates(name, layer, quantized: dict[int, float], roles: list, group_size: int, int8: bool, rows: int,
                spatial) -> LayerCandidates:
    """One layer's candidates: each precision at each level of each pruning group it belongs to (``roles``:
    ``(group, "outputs" | "inputs" | "through", {level: (channels kept, score share)})``, the group it makes
    first, then the one it reads), each costed by the core's count of what it holds."""
    main, read = (list(roles) + [("", "", UNPRUNED)] * 2)[:2]
    in_f, out_f = ((layer.in_features, layer.out_features) if isinstance(layer, nn.Linear)
                   else (layer.in_channels, layer.out_channels))
    shell = LayerCandidates(name, layer.weight.numel(), (), in_f, out_f, rows, layer.bias is not None, main[0],
                            main[1], read[0], None if spatial is None else geometry(layer, spatial),
                            "w8a8" if int8 else "weight-only")
    candidates = [Candidate(b, 0.0, value + share + in_share, sparsity=level, kept=kept, in_sparsity=in_level,
                            in_kept=in_kept)
                  for level, (kept, share) in main[2].items() for in_level, (in_kept, in_share) in read[2].items()
                  for b, value in quantized.items()]
    return dataclasses.replace(shell, candidates=tuple(
        dataclasses.replace(c, cost=_bytes(shell, c, 0 if int8 else group_size)) for c in candidates))


def _pruning(model, linears, example, levels, group_size, batches, loss_fn, base) -> dict[str, list[tuple]]:
    """Each pruned layer's ``[(group, "outputs" | "inputs" | "through", {level: (channels kept, its share of the
    group's score)})]``, level 0 included (:mod:`recal_torch.pruning_plan`), the group it makes first; a warning
    where no space can be pruned."""
    if not levels:
        return {}
    groups, why = plan_groups(model, linears, example, group_size)
    if not groups:
        warnings.warn(f"prune_levels {levels}: nothing is pruned: {why}; the plan is precision only", stacklevel=4)
    shares: dict[str, list[tuple]] = {}
    for group in groups:
        scores = group_scores(model, group, linears, levels, batches, loss_fn, base)
        members = group.producers + group.readers + group.through
        by_level = UNPRUNED | {level: (group.channels - group.pruned(level), scores[level] / len(members))
                               for level in levels if 0 < group.pruned(level) < group.channels}
        for name in members:
            role = ("outputs" if name in group.producers else "through" if name in group.through else "inputs")
            shares.setdefault(name, []).append((group.name, role, by_level))
    for name, roles in shares.items():
        roles.sort(key=lambda r: r[1] == "inputs")
        if len(roles) > 2 or (len(roles) == 2 and [r[1] for r in roles] != ["outputs", "inputs"]):
            warnings.warn(f"{name}: in pruning groups {[r[0] for r in roles]}; it is planned in the first two only, "
                          "one it makes and one it reads", stacklevel=4)
            del roles[2:]
    return shares


def _leading(batch) -> int | None:
    """The batch's sample count: the first dimension of its first tensor."""
    if isinstance(batch, torch.Tensor):
        return batch.shape[0] if batch.dim() else None
    items = batch.values() if isinstance(batch, dict) else batch if isinstance(batch, (list, tuple)) else ()
    return next((n for n in map(_leading, items) if n), None)


def _rows_per_sample(model, linears: dict[str, nn.Module], batch, loss_fn) -> tuple[dict[str, int], tuple, float,
                                                                                   dict[str, tuple[int, ...]]]:
    """Each Linear's input rows for one sample of ``batch`` (tokens of a sequence, 1 for a vector): the matmul a
    latency timer times; the model's own call on ``batch``, ``(args, kwargs)``, to trace its channels with; the
    batch's loss (the float loss's first term); and each convolution's input size (its spatial axes)."""
    seen, samples, call, spatial = {}, _leading(batch) or 1, [], {}

    def keep(name):
        def hook(module, args):
            if isinstance(module, nn.Linear):
                seen.setdefault(name, max(1, args[0].numel() // args[0].shape[-1] // samples))
            else:
                spatial.setdefault(name, tuple(args[0].shape[2:]))
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
    return seen, (call[0] if call else ((), {})), loss, spatial


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


def _output_fisher(model, linears: dict[str, nn.Module], grids, spans, batches,
                   loss_fn) -> dict[tuple[str, int], float]:
    """The ``"fisher"`` score of every layer and candidate (module docstring), averaged over ``batches``; under
    ``w8a8`` (``spans``, each layer's input range) the input quantized with the weights."""
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
                g, x = grads[name], inputs[name]
                # the rows the loss averages over: tokens (a Linear's rows), or samples (a convolution's)
                rows = g.numel() // g.shape[-1] if isinstance(layer, nn.Linear) else g.shape[0]
                y = output_of(layer, x, layer.weight)
                xq = int8_input(x, spans[name]) if name in spans else x
                for b, quantized in grids[name].items():
                    dy = output_of(layer, xq, quantized) - y
                    scores[name, b] += 0.5 * rows * float((g ** 2 * dy ** 2).sum()) / len(batches)
    model.zero_grad(set_to_none=True)
    return scores


def plan_precision(model: nn.Module, batches: Iterable, loss_fn: Callable[[nn.Module, object], torch.Tensor], *,
                   budget: float | None = None, bits_budget: float | None = None,
                   latency_budget: float | None = None, loss_budget: float | None = None,
                   timer: Callable | None = None, score: str = "measured", group_size: int = 32,
                   prune_levels: tuple[float, ...] = (), scheme: str = "weight-only", reduce_range: bool = False,
                   epochs: float = 1.0, progress: bool = False) -> PrecisionPlan:
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
        scheme: ``"weight-only"`` (Linear weights at 8, 4 or 2 bits) or ``"w8a8"`` (a CNN: each Conv1d, Conv2d and
            Linear in int8, weights and inputs, or float; the recipe the default ``QuantizationModifier`` scheme
            with the float layers in ``ignore``).
        reduce_range: with ``"w8a8"``, 7-bit weights (``|q| <= 64``) scored and written (``reduce_range: true``):
            exact on every x86 CPU, with or without VNNI.
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
    if reduce_range and scheme != "w8a8":
        raise ValueError("reduce_range: 7-bit weights are a w8a8 plan's (scheme='w8a8'); weight-only plans choose "
                         "8, 4 or 2 bits")
    if latency_budget is not None and timer is None:
        raise ValueError("latency_budget needs timer=recal_onnx.timed_candidates: the layers are timed in "
                         "onnxruntime on this CPU")
    layers, left_out = measure_precision(model, batches, loss_fn, score=score, group_size=group_size,
                                         prune_levels=prune_levels, scheme=scheme, progress=progress,
                                         bits=(7,) if reduce_range else None)
    if not layers:
        raise ValueError("no layer to plan: " + "; ".join(f"{k}: {v}" for k, v in left_out.items()))
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
    floats = [name for name, c in choice.items() if c.bits == FLOAT]
    if scheme == "w8a8" and cost == "latency" and 0 < len(floats) < len(choice):
        warnings.warn(f"the plan keeps {len(floats)} of {len(choice)} layers float ({', '.join(floats[:3])}"
                      f"{', ...' if len(floats) > 3 else ''}) between int8 ones: the Quantize and Dequantize where "
                      "they meet are in no layer's time, so the converted model may run slower than the summed "
                      f"{total(choice, 'latency'):.4g} ms; time it, or plan a CNN under a size budget",
                      RuntimeWarning, stacklevel=2)
    curve = [(spent, summed) for spent, summed, _ in pareto(layers, cost="bytes" if cost == "score" else cost,
                                                            within=within)]
    text = recipe_text(layers, choice, group_size=group_size, epochs=epochs, budget=budget, estimate=score, cost=cost,
                       within=within)
    return PrecisionPlan(layers, choice, text, curve, left_out, cost)
