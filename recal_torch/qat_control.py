"""Quantization-aware training switched on, and its BatchNorm and observers frozen, at the plan's steps."""

from __future__ import annotations

import difflib
import logging

from torch import nn

from recal_core import Problem
from recal_core import modifiers as M
from recal_core.params import strip_wrapper
from recal_core.recipe import Recipe
from recal_core.schedule import QATState

from .qat import fake_quantize_model, fake_quantizers, qat_modules, quantizable_layers

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
                    expected="Conv1d/2d/3d (zero padding) or Linear layers to quantize"))
        roots[index] = names
    return roots, problems


class QATControl:
    """Creates each QuantizationModifier's QAT modules when it starts and sets their switches."""

    def __init__(self, model: nn.Module, roots: dict[int, list[str]]):
        self.model = model
        self.roots = roots
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
        for name, root in zip(self.roots[index], self._modules(index)):
            created = fake_quantize_model(root)
            log.info("QAT on %s: %d layers quantized (step %d)", name or type(root).__name__, len(created), step)
        self.prepared.add(index)

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
