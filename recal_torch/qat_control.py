"""Quantization-aware training switched on, and its BatchNorm and observers frozen, at the plan's steps."""

from __future__ import annotations

import difflib
import logging
from collections import Counter

from torch import nn

from recal_core import Problem
from recal_core import modifiers as M
from recal_core.params import strip_wrapper
from recal_core.recipe import Recipe
from recal_core.schedule import QATState

from .qat_modules import QATModule, describe, fake_quantizers, is_table, qat_modules
from .qat_plan import FLOAT_REASON, fake_quantize_model, quantizable_layers
from .qat_attention import AttentionFakeQuantize, quantize_attention

log = logging.getLogger(__name__)


def qat_roots(recipe: Recipe, model: nn.Module) -> tuple[dict[int, list[str]], list[Problem]]:
    """Each QuantizationModifier's submodule names (``""``: the whole model), and what does not resolve."""
    roots: dict[int, list[str]] = {}
    problems = []
    available = {n for n, _ in model.named_modules()}
    for index, m in recipe.of_type(M.QuantizationModifier):
        names = [strip_wrapper(n) for n in (m.submodules or [""])]
        for name in names:
            if name not in available:
                close = difflib.get_close_matches(name, sorted(available), n=5, cutoff=0.4)
                problems.append(recipe.problem(index, "submodules", f"no submodule named {name!r}",
                                               expected="one of " + (", ".join(close) or "the model's modules")))
            elif not quantizable_layers(model.get_submodule(name)):
                problems.append(recipe.problem(
                    index, "submodules" if name else None,
                    f"{'submodule ' + repr(name) if name else 'the model'} has no quantizable layer",
                    expected="Conv1d/2d/3d (zero padding), Linear or Embedding layers to quantize"))
        roots[index] = names
    return roots, problems


def _matches(entry: str, name: str, modules: dict[str, nn.Module]) -> bool:
    """SparseML's rule: ``entry`` names the module, one of its parents, or the class of either."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        prefix = ".".join(parts[:i])
        if prefix == entry or type(modules[prefix]).__name__ == entry:
            return True
    return False


def float_layers(recipe: Recipe, model: nn.Module) -> tuple[dict[int, set[str]], list[Problem], list[str]]:
    """Per QuantizationModifier, the Conv/Linear layers its ``ignore`` and ``scheme_overrides`` leave float;
    the overrides recal cannot honour (errors); and what it notes about entries it does not apply."""
    modules = {n: m for n, m in model.named_modules() if n}
    layers = set(quantizable_layers(model))
    left: dict[int, set[str]] = {}
    problems, notes = [], []
    for index, m in recipe.of_type(M.QuantizationModifier):
        left[index] = set()
        where = f"{recipe.describe(index)}"
        for entry in m.ignore or ():
            if not any(_matches(entry, n, modules) for n in modules):
                notes.append(f"{recipe.location(index, 'ignore')}: {where}: ignore entry {entry!r} names no module "
                             "or module class of this model")
            left[index] |= {n for n in layers if _matches(entry, n, modules)}
        for entry, scheme in (m.scheme_overrides or {}).items():
            matched = {n for n in modules if _matches(entry, n, modules)}
            quantized = matched & layers
            loc = recipe.location(index, "scheme_overrides")
            tables = {n for n in quantized if is_table(modules[n])}  # only their weights are quantized
            if tables and scheme.weights is None:
                left[index] |= tables
            elif tables and scheme.table_conflicts_with_recal():
                problems.append(recipe.problem(
                    index, "scheme_overrides", f"{entry!r} ({', '.join(sorted(tables)[:3])}): recal's QAT does not "
                    f"do {'; '.join(scheme.table_conflicts_with_recal())}",
                    expected="weights: null (the table stays float) or int8 symmetric per-channel (per-row) weights"))
            convs_and_linears = quantized - tables
            if not matched:
                notes.append(f"{loc}: {where}: scheme_overrides entry {entry!r} names no module or module class "
                             "of this model")
            elif convs_and_linears and scheme.leaves_float:
                left[index] |= convs_and_linears
            elif convs_and_linears and scheme.conflicts_with_recal():
                problems.append(recipe.problem(
                    index, "scheme_overrides", f"{entry!r} ({', '.join(sorted(convs_and_linears)[:3])}...): "
                    f"recal's QAT does not do {'; '.join(scheme.conflicts_with_recal())}",
                    expected="null for every tensor (float), int8 symmetric per-channel weights with uint8 "
                             "asymmetric activations, or the layer in ignore"))
            elif not quantized and (scheme.input_activations or scheme.output_activations
                                    or (scheme.weights and any(next(modules[n].parameters(False), None) is not None
                                                               for n in matched))):
                kinds = ", ".join(sorted({type(modules[n]).__name__ for n in matched}))
                notes.append(f"{loc}: {where}: scheme_overrides entry {entry!r} asks to quantize {kinds}, which "
                             "recal's QAT leaves float (it quantizes Conv, Linear and Embedding layers)")
    return left, problems, notes


class QATControl:
    """Creates each QuantizationModifier's QAT modules when it starts and sets their switches."""

    def __init__(self, model: nn.Module, roots: dict[int, list[str]], left_float: dict[int, set[str]] | None = None,
                 attention: bool = False, reduce_range: dict[int, bool] | None = None):
        self.model = model
        self.roots = roots
        self.reduce_range = reduce_range or {}  # per QuantizationModifier: 7-bit weights
        self.left_float = left_float or {}
        self.attention = attention  # also the attention matmuls (Q·Kᵀ, P·V): recal_torch.qat_attention
        self.prepared: set[int] = set()
        self._applied: dict[int, tuple[bool, bool]] = {}

    def apply(self, states: list[tuple[int, QATState]], step: int) -> None:
        for index, state in states:
            if not state.enabled:
                continue
            if index not in self.prepared:
                self.prepare(index, step)
            flags = (state.bn_frozen, state.observers_frozen)
            if self._applied.get(index) != flags:
                for root in self._modules(index):
                    for module in qat_modules(root):
                        module.bn_frozen = state.bn_frozen
                    for fq in fake_quantizers(root):
                        fq.observer_enabled = not state.observers_frozen
                self._applied[index] = flags

    def prepare(self, index: int, step: int) -> None:
        left = self.left_float.get(index, set())
        for name, root in zip(self.roots[index], self._modules(index)):
            prefix = name + "." if name else ""
            skip = {n[len(prefix):] for n in left if n.startswith(prefix)}
            created = fake_quantize_model(root, skip=skip, reduce_range=self.reduce_range.get(index, False))
            if self.attention:
                attended = quantize_attention(root, skip=skip)
                log.info("QAT on %s: the matmuls of %d attention modules quantized", name or type(root).__name__,
                         len(attended))
            kinds = Counter(type(m).__name__.removeprefix("QAT") for m in created)
            log.info("QAT on %s: %d layers quantized (%s) at step %d; manager.quantized_layers lists them",
                     name or type(root).__name__, len(created), ", ".join(f"{n} {k}" for k, n in kinds.items()),
                     step)
            if skip:
                log.info("QAT on %s: left float by the recipe: %s", name or type(root).__name__,
                         ", ".join(sorted(prefix + n for n in skip)))
        self.prepared.add(index)

    def quantized_layers(self) -> dict[str, str]:
        """Each QAT layer's name and what is quantized in it (see :func:`recal_torch.qat.describe`); a layer the
        planner left float, with why."""
        layers = {name: describe(m) for name, m in self.model.named_modules() if isinstance(m, QATModule)}
        for name, m in self.model.named_modules():  # what the planner left float, and why
            if FLOAT_REASON in m.__dict__:
                layers[name] = f"float: {m.__dict__[FLOAT_REASON]}"
        for name, m in self.model.named_modules():
            if isinstance(m, AttentionFakeQuantize):
                layers[name.rpartition(".")[0]] = "attention matmuls Q·Kᵀ and P·V, operands uint8"
        return layers

    def reset(self) -> None:
        """Forget the switches applied (after a checkpoint is loaded they are applied again)."""
        self._applied = {}

    def freeze(self) -> None:
        """End of training: BatchNorm statistics and observers frozen for good."""
        for module in qat_modules(self.model):
            module.bn_frozen = True
        for fq in fake_quantizers(self.model):
            fq.observer_enabled = False

    def _modules(self, index: int) -> list[nn.Module]:
        return [self.model.get_submodule(name) for name in self.roots[index]]
