"""Quantization-aware training switched on, and its BatchNorm and observers frozen, at the plan's steps."""

from __future__ import annotations

import difflib
import logging
import warnings
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from torch import nn

from recal_core import Problem
from recal_core import modifiers as M
from recal_core.params import strip_wrapper
from recal_core.patterns import PatternBudget
from recal_core.recipe import Recipe
from recal_core.schedule import QATState

from .inventory import describe, fake_quantizers, qat_modules
from .layers import QATModule, features, is_linear_like, is_table, linears_left_float
from .weight_only import WeightOnlyEmbedding, WeightOnlyLinear
from ..errors import QATPlanWarning
from .plan import FLOAT_REASON, fake_quantize_model, quantizable_layers, replace_layer
from .attention import AttentionFakeQuantize, quantize_attention

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
        odd = [f for name in names if name in available for f in linears_left_float(model.get_submodule(name))]
        if odd:
            warnings.warn(f"QuantizationModifier (modifiers[{index}]): {len(odd)} Linear layers stay float: "
                          f"{', '.join(odd[:4])}{'...' if len(odd) > 4 else ''}: a subclass of nn.Linear whose own "
                          "forward computes something other than x @ W.T + b, which a QAT linear would replace",
                          QATPlanWarning, stacklevel=3)
    return roots, problems


def _matcher(entry: str, modules: dict[str, nn.Module], budget: PatternBudget) -> Callable[[str], bool]:
    """SparseML's rule: ``entry`` names the module, one of its parents, or the class of either; ``re:...``
    (llm-compressor's spelling) matches the whole name of the module or a parent, within the recipe's time budget."""
    hits = budget.fullmatches(entry, tuple(modules)) if entry.startswith("re:") else None

    def matches(name: str) -> bool:
        parts = name.split(".")
        for i in range(len(parts), 0, -1):
            prefix = ".".join(parts[:i])
            if prefix in hits if hits is not None else prefix == entry or type(modules[prefix]).__name__ == entry:
                return True
        return False

    return matches


@dataclass
class LayerSchemes:
    """What each QuantizationModifier's ``scheme``, ``scheme_overrides`` and ``ignore`` make of the model's layers."""

    left_float: dict[int, set[str]] = field(default_factory=dict)  # Conv/Linear/Embedding layers that stay float
    weight_only: dict[int, dict[str, M.QuantizationArgs]] = field(default_factory=dict)  # W4A16 / W8A16 linears
    # W8A8 lsq: per layer, the QuantizationArgs of its weights and input activations that learn (None: observed)
    learned: dict[int, dict[str, tuple[M.QuantizationArgs | None, ...]]] = field(default_factory=dict)
    problems: list[Problem] = field(default_factory=list)  # what recal cannot honour (errors)
    notes: list[str] = field(default_factory=list)  # entries that apply to nothing (warnings)


def input_groups(schemes: LayerSchemes) -> Callable[[str], int]:
    """Per weight (a parameter name, wrapped or not), the inputs one scale covers when the recipe makes its layer
    weight-only in groups (1: otherwise): what structured pruning keeps whole so that thinning can remove it."""
    sizes = {layer: args.group_size for per in schemes.weight_only.values() for layer, args in per.items()
             if args.group_size}
    return lambda weight: sizes.get(strip_wrapper(weight.rsplit(".", 1)[0]), 1)


def layer_schemes(recipe: Recipe, model: nn.Module) -> LayerSchemes:
    """Per QuantizationModifier, how each quantizable layer is quantized: the modifier's ``scheme`` (a preset, or
    W8A8), replaced by the last ``scheme_overrides`` entry that names the layer, a parent or either's class; the
    layers ``ignore`` names stay float."""
    modules = {n: m for n, m in model.named_modules() if n}
    layers = set(quantizable_layers(model))
    out = LayerSchemes()
    budget = PatternBudget()
    for index, m in recipe.of_type(M.QuantizationModifier):
        out.left_float[index], out.weight_only[index], out.learned[index] = set(), {}, {}
        where = f"{recipe.describe(index)}"
        for entry in m.ignore or ():
            matches = _matcher(entry, modules, budget)
            if not any(matches(n) for n in modules):
                out.notes.append(f"{recipe.location(index, 'ignore')}: {where}: ignore entry {entry!r} names no "
                                 "module or module class of this model")
            out.left_float[index] |= {n for n in layers if matches(n)}
        chosen: dict[str, tuple[str, str | None, M.QuantizationScheme]] = {
            n: ("scheme", None, m.base_scheme) for n in layers - out.left_float[index]}
        for entry, scheme in (m.scheme_overrides or {}).items():
            matches = _matcher(entry, modules, budget)
            matched = {n for n in modules if matches(n)}
            quantized = matched & layers
            loc = recipe.location(index, "scheme_overrides")
            if not matched:
                out.notes.append(f"{loc}: {where}: scheme_overrides entry {entry!r} names no module or module class "
                                 "of this model")
            elif not quantized and (scheme.input_activations or scheme.output_activations
                                    or (scheme.weights and any(next(modules[n].parameters(False), None) is not None
                                                               for n in matched))):
                kinds = ", ".join(sorted({type(modules[n]).__name__ for n in matched}))
                out.notes.append(f"{loc}: {where}: scheme_overrides entry {entry!r} asks to quantize {kinds}, which "
                                 "recal's QAT leaves float (it quantizes Conv, Linear and Embedding layers)")
            chosen.update({n: ("scheme_overrides", entry, scheme) for n in quantized - out.left_float[index]})
        by_source: dict[tuple[str, str | None], list[str]] = {}
        for name, (source, entry, _) in sorted(chosen.items()):
            by_source.setdefault((source, entry), []).append(name)
        for (source, entry), names in by_source.items():
            _apply_scheme(recipe, index, source, entry, chosen[names[0]][2], names, modules, out)
    return out


def _apply_scheme(recipe: Recipe, index: int, source: str, entry: str | None, scheme: M.QuantizationScheme,
                  names: list[str], modules: dict[str, nn.Module], out: LayerSchemes) -> None:
    """Sort the layers one scheme (``scheme``, or one ``scheme_overrides`` entry) covers; refuse what recal cannot
    do."""
    label = f"{entry!r} " if entry is not None else ""
    tables = [n for n in names if is_table(modules[n])]
    others = [n for n in names if n not in tables]
    if tables and scheme.weights is None:
        out.left_float[index] |= set(tables)
    elif tables and source == "scheme_overrides" and scheme.table_conflicts_with_recal():
        out.problems.append(recipe.problem(
            index, source, f"{label}({', '.join(tables[:3])}): recal's QAT does not do "
            f"{'; '.join(scheme.table_conflicts_with_recal())}",
            expected="weights: null (the table stays float), or symmetric 8- or 4-bit weights per row or group"))
    elif tables and source == "scheme_overrides" and not scheme.table_is_int8_per_row:
        _weight_only(recipe, index, source, label, scheme.weights, tables, modules, out)
    if not others:
        return
    if scheme.leaves_float:
        out.left_float[index] |= set(others)
    elif scheme.conflicts_with_recal():
        out.problems.append(recipe.problem(
            index, source, f"{label}({', '.join(others[:3])}{'...' if len(others) > 3 else ''}): recal's QAT does "
            f"not do {'; '.join(scheme.conflicts_with_recal())}",
            expected="null for every tensor (float), int8 symmetric per-channel weights with uint8 asymmetric "
                     "activations (W8A8), weight-only symmetric 8- or 4-bit weights per channel or group (W8A16, "
                     "W4A16), or the layer in ignore"))
    elif scheme.learned is not None:  # W8A8 with learned scales
        out.learned[index].update({n: scheme.learned for n in others})
    elif scheme.weight_only:
        convs = [n for n in others if not is_linear_like(modules[n])]
        if convs:
            out.problems.append(recipe.problem(
                index, source, f"{label}is weight-only, which recal does for Linear layers, not for "
                f"{', '.join(convs[:3])}{'...' if len(convs) > 3 else ''} ({type(modules[convs[0]]).__name__})",
                expected="the convs in ignore, or a W8A8 scheme for them in scheme_overrides"))
        else:
            _weight_only(recipe, index, source, label, scheme.weights, others, modules, out)


def _weight_only(recipe: Recipe, index: int, source: str, label: str, args: M.QuantizationArgs, names: list[str],
                 modules: dict[str, nn.Module], out: LayerSchemes) -> None:
    """Linears (or tables) made weight-only with ``args``, unless ``group_size`` does not divide their inputs."""
    uneven = [f"{n} ({features(modules[n])[0]} inputs)" for n in names
              if args.group_size and features(modules[n])[0] % args.group_size]
    if uneven:
        out.problems.append(recipe.problem(
            index, source, f"{label}group_size {args.group_size} does not divide the inputs of "
            f"{', '.join(uneven[:3])}{'...' if len(uneven) > 3 else ''}",
            expected="a group_size that divides every layer's inputs, or those layers in scheme_overrides"))
    else:
        out.weight_only[index].update({n: args for n in names})


class QATControl:
    """Creates each QuantizationModifier's QAT modules when it starts and sets their switches."""

    def __init__(self, model: nn.Module, roots: dict[int, list[str]], left_float: dict[int, set[str]] | None = None,
                 attention: bool = False, reduce_range: dict[int, bool] | None = None,
                 weight_only: dict[int, dict[str, M.QuantizationArgs]] | None = None,
                 learned: dict[int, dict[str, tuple[M.QuantizationArgs | None, ...]]] | None = None):
        self.model = model
        self.learned = learned or {}  # per QuantizationModifier: W8A8 layers whose weights / inputs learn scales
        self.weight_only = weight_only or {}  # per QuantizationModifier: the W4A16 / W8A16 layers and their weights
        self.roots = roots
        self.reduce_range = reduce_range or {}  # per QuantizationModifier: 7-bit weights
        self.left_float = left_float or {}
        self.attention = attention  # also the attention matmuls (Q·Kᵀ, P·V): recal_torch.qat.attention
        self.prepared: set[int] = set()
        self._applied: dict[int, tuple[bool, bool]] = {}
        # learned (lsq) scales, when a QuantizationModifier makes them: called with them and their LR factor (the
        # manager gives them a param group of the optimizer)
        self.on_learned_scales: Callable[[list[nn.Parameter], float], None] | None = None

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
            weight_only = {n[len(prefix):]: args for n, args in self.weight_only.get(index, {}).items()
                           if n.startswith(prefix)}
            created = fake_quantize_model(root, skip=skip | set(weight_only),
                                          reduce_range=self.reduce_range.get(index, False))
            learned: dict[float, list[nn.Parameter]] = {}
            chosen = {n[len(prefix):]: how for n, how in self.learned.get(index, {}).items() if n.startswith(prefix)}
            for rel, layer in root.named_modules():
                how = chosen.get(rel)
                if how is None or not isinstance(layer, QATModule):
                    continue
                weights, inputs = how
                if weights is not None:
                    learned.setdefault(weights.lr_factor, []).append(layer.weight_fake_quant.learn())
                if inputs is not None and layer.input_fake_quant is not None:
                    scale = layer.input_fake_quant.learn(inputs.calibration_steps)
                    learned.setdefault(inputs.lr_factor, []).append(scale)
            for rel, args in weight_only.items():
                float_layer = root.get_submodule(rel)
                kind = WeightOnlyEmbedding if is_table(float_layer) else WeightOnlyLinear
                layer = kind(float_layer, args.num_bits, args.group_size if args.strategy == "group" else None,
                             args.observer)
                layer = replace_layer(root, rel, layer)
                if layer.weight_fake_quant.learned:
                    learned.setdefault(args.lr_factor, []).append(layer.weight_fake_quant.scale)
            for factor, scales in learned.items():
                if self.on_learned_scales is not None:
                    self.on_learned_scales(scales, factor)
                log.info("QAT on %s: %d scales learned (lsq), LR x%g", name or type(root).__name__,
                         len(scales), factor)
            if weight_only:
                bits = Counter(args.num_bits for args in weight_only.values())
                log.info("QAT on %s: %s weight-only layers (activations float)", name or type(root).__name__,
                         ", ".join(f"{n} int{b}" for b, n in sorted(bits.items())))
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
        layers = {name: describe(m) for name, m in self.model.named_modules()
                  if isinstance(m, (QATModule, WeightOnlyLinear))}
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
