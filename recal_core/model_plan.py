"""A recipe bound to one model: what every backend applies at step ``k``, decided here, once.

A backend describes its parameters (:class:`~recal_core.params.ParamInfo` and sizes) and its
optimizer's param groups (their own LR and weight decay); :func:`plan_model` resolves every
modifier's ``params`` (every failure in one located :class:`~recal_core.errors.RecipeError`) and
returns a :class:`ModelPlan`, whose queries are pure functions of the step. Backends only apply
the values.

How modifiers combine (the same in every backend):

- **masks**: a parameter's mask in force at ``k`` is the product of the masks of the pruning
  modifiers in force at ``k``. A modifier's mask is recomputed at its update steps from the weight
  *with the masks in force at* ``k - 1`` *applied* (so a weight pruned earlier and moved by the
  optimizer since is never ranked back in): GradualKS zeroes the ``count`` smallest magnitudes (ties
  broken by flat position), ConstantKS keeps that weight's zeros.
- **trainable**: a parameter's flag at ``k`` is the one of the TrainableParamsModifier in force at
  ``k`` that started last (a tie goes to the later one in the recipe), else its own original flag.
- **learning rate** and **weight decay**: per param group, functions of the step from the group's
  own values (:meth:`~recal_core.schedule.RecipeSchedule.lr_function`,
  :meth:`~recal_core.schedule.RecipeSchedule.weight_decay_function`).
- **QAT**: each QuantizationModifier's switches at ``k`` (:meth:`~recal_core.schedule.RecipeSchedule.qat`).
"""

from __future__ import annotations

import math

from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

from .channel_coupling import CouplingError, ModelGraph, Space, channel_pruned, followers_of, pruning_groups
from .head_coupling import head_groups
from .errors import Problem, RecipeError
from .mask_layout import MaskLayout, mask_layout
from .modifiers import (LearningRateFunctionModifier, MFACPruningModifier, OBSPruningModifier, SetLearningRateModifier,
                        SetWeightDecayModifier)
from .params import ParamInfo, resolve_params
from .patterns import PatternBudget
from .schedule import PruningSchedule, QATState, RecipeSchedule
from .schedules import pruned_count


def _is_global(ps: PruningSchedule) -> bool:
    return bool(getattr(ps.modifier, "global_sparsity", False))


def is_second_order(ps: PruningSchedule) -> bool:
    """An OBS or M-FAC modifier: its masks (and weight updates) are the backend's second-order step, not a
    ranking."""
    return isinstance(ps.modifier, (OBSPruningModifier, MFACPruningModifier))


def second_order_group(m: OBSPruningModifier | MFACPruningModifier) -> int:
    """Weights a second-order group holds: 4 consecutive weights of the flattened kernel with ``block4``
    (along the input features of a Linear layer), else 1."""
    return 4 if m.mask_type == (1, 4) else 1


@dataclass(frozen=True)
class MaskUpdate:
    """One pruning modifier's mask on one parameter, recomputed at a step."""

    modifier: int  # the modifier's index in the recipe
    count: int | None  # zeros the mask holds (smallest magnitudes); None: keep the weight's zeros
    layout: MaskLayout | None = None  # a structured mask: ``count`` is then groups (N:M: per run of M)


@dataclass(frozen=True)
class MaskPlan:
    """The pruning modifiers that mask one parameter, and how their masks combine."""

    name: str
    numel: int
    sources: tuple[PruningSchedule, ...]
    layouts: dict[int, MaskLayout] = field(default_factory=dict)  # modifier -> structured layout
    coupled: frozenset[int] = frozenset()  # modifiers whose masks come from a ChannelGroup

    def in_force(self, k: int) -> tuple[int, ...]:
        """Indices of the modifiers whose masks multiply into the mask in force at ``k``."""
        return tuple(ps.index for ps in self.sources if ps.mask_in_force(k))

    def updates(self, k: int) -> tuple[MaskUpdate, ...]:
        """The masks recomputed at ``k`` (rank the weight with the masks of ``in_force(k - 1)`` applied);
        global, second-order and channel-coupled modifiers' masks come from :class:`ModelPlan` instead."""
        return tuple(MaskUpdate(ps.index, self.count(ps, k), self.layouts.get(ps.index)) for ps in self.sources
                     if ps.is_update(k) and ps.mask_in_force(k) and not _is_global(ps) and not is_second_order(ps)
                     and ps.index not in self.coupled)

    def count(self, ps: PruningSchedule, k: int) -> int | None:
        """Zeros of ``ps``'s mask after an update at ``k`` (None for ConstantKS); for a structured
        mask, the groups it zeroes (N:M: the weights of every run of M)."""
        if ps.constant:
            return None
        layout = self.layouts.get(ps.index)
        return pruned_count(ps.sparsity(k), self.numel) if layout is None else layout.count(ps.sparsity(k))

    def zeros(self, ps: PruningSchedule, k: int) -> int:
        """The exact number of zeros ``ps``'s mask holds after an update at ``k``."""
        layout = self.layouts.get(ps.index)
        return self.count(ps, k) if layout is None else layout.zeros_at(ps.sparsity(k))


@dataclass(frozen=True)
class ChannelGroup:
    """Weights that prune the same channels (:mod:`recal_core.channel_coupling`), ranked together by the
    summed squared norms of their channels: the producers of one channel space (``filter``) or its
    consumers (``channel``), and the per-channel tensors zeroed with a pruned filter."""

    modifier: int
    kind: str  # "filter" | "channel" | "head"
    members: dict[str, int]  # weight -> features per channel along its pruned axis (1, or S after a flatten)
    followers: tuple[str, ...]  # biases, BatchNorm shifts and running means, depthwise filters (filter groups)
    channels: int
    inputs: frozenset[str] = frozenset()  # members pruned along their input axis (a head's output projection)
    follower_widths: Mapping[str, int] = field(default_factory=dict)  # elements per channel (absent: 1)
    block: int = 1  # channels ranked and pruned together: a weight-only reader's quantization group, in channels

    def along_input(self, weight: str) -> bool:
        """Whether ``weight`` loses input columns (channel groups, a head's output projection) or rows."""
        return self.kind == "channel" or weight in self.inputs


@dataclass(frozen=True)
class GlobalUpdate:
    """A ``global_sparsity`` modifier's masks, recomputed together at a step: the ``count`` smallest
    magnitudes across ``names`` (ranked on the weights with the masks of ``k - 1`` applied, the
    parameters concatenated in model order, ties by that position)."""

    modifier: int
    names: tuple[str, ...]
    count: int


@dataclass(frozen=True)
class GroupPlan:
    """One optimizer param group's LR and weight decay as functions of the step (None: leave as is)."""

    lr: Callable[[int], float | None]
    weight_decay: Callable[[int], float | None]


class ModelPlan:
    """A :class:`RecipeSchedule` resolved against one model's parameters and param groups."""

    def __init__(self, schedule: RecipeSchedule, masks: dict[str, MaskPlan], prune_targets: dict[int, list[str]],
                 trainable_targets: dict[int, list[str]], groups: list[GroupPlan],
                 channel_groups: Sequence[ChannelGroup] = ()):
        self.schedule = schedule
        self.channel_groups = tuple(channel_groups)
        self.masks = masks  # parameter name -> its plan, model order
        self.prune_targets = prune_targets  # pruning modifier index -> parameter names
        self.trainable_targets = trainable_targets  # TrainableParamsModifier index -> parameter names
        self.groups = groups

    def global_updates(self, k: int) -> list[GlobalUpdate]:
        """The global modifiers whose masks are recomputed at ``k``, with the total zeros they hold."""
        out = []
        for ps in self.schedule.pruning:
            if _is_global(ps) and not is_second_order(ps) and ps.is_update(k) and ps.mask_in_force(k):
                out.append(GlobalUpdate(ps.index, tuple(self.prune_targets[ps.index]), self.global_zeros(ps.index, k)))
        return out

    def channel_count(self, group: ChannelGroup, k: int) -> int:
        """The channels ``group`` zeroes after an update at ``k``: ``floor(s * channels + 0.5)``, or, for a
        group pruned in blocks, ``floor(s * blocks + 0.5)`` whole blocks; an attention keeps one block of heads."""
        total = group.channels // group.block
        blocks = pruned_count(self._pruning(group.modifier).sparsity(k), total)
        return min(blocks, total - 1 if group.kind == "head" else total) * group.block

    def channel_updates(self, k: int) -> list[tuple[ChannelGroup, int]]:
        """The channel groups whose masks are recomputed at ``k``, with the channels they zero."""
        return [(g, self.channel_count(g, k)) for g in self.channel_groups
                if (ps := self._pruning(g.modifier)).is_update(k) and ps.mask_in_force(k)]

    def _pruning(self, index: int) -> PruningSchedule:
        return next(p for p in self.schedule.pruning if p.index == index)

    def curvature_bytes(self) -> list[tuple[PruningSchedule, int]]:
        """Per OBS / M-FAC modifier, the float32 bytes its curvature holds: the Fisher blocks (block size
        values per weight, OBS) or the gradient window (``num_grads`` values per weight, M-FAC)."""
        out = []
        for ps in self.schedule.pruning:
            if is_second_order(ps):
                m = ps.modifier
                per_weight = m.num_grads if isinstance(m, MFACPruningModifier) else m.fisher_block_size
                numel = sum(self.masks[n].numel for n in self.prune_targets[ps.index])
                out.append((ps, 4 * per_weight * numel))
        return out

    def second_order_updates(self, k: int) -> list[tuple[PruningSchedule, dict[str, int] | int]]:
        """The OBS modifiers updating at ``k``, each with the groups its step removes (groups of
        :func:`second_order_group` weights): ``floor(s * groups + 0.5)`` per layer, or one count across its
        layers with ``global_sparsity``."""
        out = []
        for ps in self.schedule.pruning:
            if is_second_order(ps) and ps.is_update(k) and ps.mask_in_force(k):
                size, s = second_order_group(ps.modifier), ps.sparsity(k)
                groups = {n: self.masks[n].numel // size for n in self.prune_targets[ps.index]}
                out.append((ps, pruned_count(s, sum(groups.values())) if _is_global(ps)
                            else {n: pruned_count(s, g) for n, g in groups.items()}))
        return out

    def global_zeros(self, index: int, k: int) -> int:
        """The exact zeros global modifier ``index`` holds across its layers after an update at ``k``."""
        return pruned_count(self._pruning(index).sparsity(k),
                            sum(self.masks[n].numel for n in self.prune_targets[index]))

    @property
    def trainable_names(self) -> list[str]:
        """Every parameter some TrainableParamsModifier names (their flags are the plan's to set)."""
        return list(dict.fromkeys(n for names in self.trainable_targets.values() for n in names))

    def trainable_rules(self, k: int) -> tuple[int, ...]:
        """The TrainableParamsModifiers in force at ``k``: the flags change only when this does."""
        return tuple(i for i, _ in self.schedule.trainable_rules(k))

    def trainable(self, k: int, original: Mapping[str, bool]) -> dict[str, bool]:
        """The flag of every parameter in :attr:`trainable_names` at ``k`` (``original``: its own flag)."""
        flags = {name: original[name] for name in self.trainable_names}
        for index, m in self.schedule.trainable_rules(k):
            for name in self.trainable_targets[index]:
                flags[name] = m.trainable
        return flags

    def qat(self, k: int) -> list[tuple[int, QATState]]:
        """Each QuantizationModifier's index and switches at ``k``."""
        return [(index, self.schedule.qat(index, k)) for index, _ in self.schedule.quantization]


def plan_groups(schedule: RecipeSchedule,
                groups: Sequence[tuple[float | None, float | None]]) -> list[GroupPlan]:
    """Each param group's LR and weight decay from its own ``(lr, weight_decay)``; a located
    :class:`RecipeError` when a value needs an LR the group lacks or a recipe names a missing group."""
    problems: list[Problem] = []
    recipe = schedule.recipe
    plans = []
    for g, (base_lr, _) in enumerate(groups):
        try:
            lr = schedule.lr_function(base_lr, g)
        except RecipeError as err:
            problems.extend(p for p in err.problems if p not in problems)
            continue
        plans.append(GroupPlan(lr, schedule.weight_decay_function(g, [wd for _, wd in groups])))
    for index, m in recipe.of_type((SetWeightDecayModifier, SetLearningRateModifier, LearningRateFunctionModifier)):
        missing = [g for g in (m.param_groups or ()) if g >= len(groups)]
        if missing:
            problems.append(recipe.problem(index, "param_groups", f"there is no param group {missing[0]}",
                                           expected=f"indices below {len(groups)} (the optimizer's param groups)"))
    if problems:
        raise RecipeError(problems)
    return plans


def plan_model(schedule: RecipeSchedule, params: Sequence[ParamInfo], sizes: Mapping[str, int], *,
               groups: Sequence[tuple[float | None, float | None]] = ((None, None),),
               channel_spaces: Callable[[], list[Space] | ModelGraph] | None = None,
               input_groups: Callable[[str], int] | None = None) -> ModelPlan:
    """Resolve ``schedule``'s recipe against a model; every problem at once in one :class:`RecipeError`.

    ``groups``: each optimizer param group's own ``(lr, weight_decay)`` (None: unknown or absent).
    ``channel_spaces``: the backend's reader of the model's channel spaces (and attentions), called only
    when a modifier prunes ``filter``, ``channel`` or ``head`` (without it, filter and channel masks rank
    each layer alone, and head masks are refused).
    ``input_groups``: per weight, the inputs that share one quantization scale when the recipe makes its layer
    weight-only in groups (1: none): channels and heads that such a layer reads are pruned in whole groups, so
    thinning can remove them and the int4 layer keeps its groups.

    >>> from recal_core import load_recipe
    >>> r = load_recipe("- !GradualKSModifier {params: [fc], init_sparsity: 0.5, final_sparsity: 0.5, "
    ...                 "start_epoch: 0, end_epoch: 1, update_frequency: 1}")
    >>> plan = plan_model(r.bind(2), [ParamInfo("fc.weight", "fc", True)], {"fc.weight": 10})
    >>> plan.masks["fc.weight"].updates(0)
    (MaskUpdate(modifier=0, count=5),)
    """
    problems: list[Problem] = []
    recipe = schedule.recipe
    budget = PatternBudget()  # one for the whole recipe, however many modifiers repeat a pattern

    def resolve(index: int, pruning: bool) -> list[str]:
        try:
            return [p.name for p in resolve_params(recipe, index, params, pruning=pruning, budget=budget)]
        except RecipeError as err:
            problems.extend(err.problems)
            return []

    prune_targets = {ps.index: resolve(ps.index, True) for ps in schedule.pruning}
    trainable_targets = {index: resolve(index, False) for index, _, _ in schedule.trainable}
    try:
        group_plans = plan_groups(schedule, groups)
    except RecipeError as err:
        problems.extend(err.problems)
    if problems:
        raise RecipeError(problems)
    by_param: dict[str, list[PruningSchedule]] = {}
    for ps in schedule.pruning:
        for name in prune_targets[ps.index]:
            by_param.setdefault(name, []).append(ps)
    infos = {p.name: p for p in params}
    layouts: dict[str, dict[int, MaskLayout]] = {}
    for ps in schedule.pruning:
        kind = getattr(ps.modifier, "mask_type", "unstructured")
        if kind == "unstructured" or is_second_order(ps):  # OBS takes its blocks from the Fisher blocks
            continue
        for name in prune_targets[ps.index]:
            info = infos[name]
            if info.kernel_axes is None or len(info.kernel_axes) != len(info.shape):
                problems.append(recipe.problem(ps.index, "mask_type", f"{name} has no known [out, in] layout for a "
                                               f"{kind!r} mask", expected="unstructured for this layer"))
                continue
            try:
                layouts.setdefault(name, {})[ps.index] = mask_layout(
                    kind, tuple(info.shape[a] for a in info.kernel_axes))
            except ValueError as exc:
                problems.append(recipe.problem(ps.index, "mask_type", f"{name}: {exc}",
                                               expected="a mask type this layer's shape takes"))
    channel_groups: list[ChannelGroup] = []
    pruned = channel_pruned(layouts)
    heads = [i for i, kind in pruned.values() if kind == "head"]
    if heads and channel_spaces is None:
        problems.append(_no_attentions(recipe, heads[0]))
    if pruned and channel_spaces is not None and not problems:
        try:
            traced = channel_spaces()
            graph = traced if isinstance(traced, ModelGraph) else ModelGraph(list(traced))
        except Exception as exc:  # noqa: BLE001 - the backend cannot read this model's graph (an fx trace failed)
            first = str(exc).splitlines()[0] if str(exc) else ""
            traced = graph = None
            problems.append(recipe.problem(
                next(iter(pruned.values()))[0], "mask_type", f"structured pruning reads the model's graph to "
                f"find the layers that share channels, and cannot: {type(exc).__name__}: {first}",
                expected="a model the backend can trace (torch.fx, or torch.export with example inputs), or an "
                "unstructured or block mask_type"))
        if heads and traced is not None and not isinstance(traced, ModelGraph):  # a backend tracing no attention
            problems.append(_no_attentions(recipe, heads[0]))
            graph = None
        try:
            channel_groups = _channel_groups(graph, pruned, infos, input_groups or (lambda weight: 1)) \
                if graph is not None else []
        except CouplingError as exc:
            problems.append(recipe.problem(exc.modifier, "mask_type", str(exc),
                                           expected="channels every layer sharing them can drop"))
    if problems:
        raise RecipeError(problems)
    coupled: dict[str, set[int]] = {}
    for g in channel_groups:
        for name in g.members:
            coupled.setdefault(name, set()).add(g.modifier)
    masks = {p.name: MaskPlan(p.name, int(sizes[p.name]), tuple(by_param[p.name]), layouts.get(p.name, {}),
                              frozenset(coupled.get(p.name, ())))
             for p in params if p.name in by_param}
    return ModelPlan(schedule, masks, prune_targets, trainable_targets, group_plans, channel_groups)


def _no_attentions(recipe, index: int) -> Problem:
    return recipe.problem(index, "mask_type", "head pruning needs the model's attentions traced, which only the "
                          "PyTorch backend does", expected="filter, channel, a block shape or unstructured in this "
                          "framework")


def _channel_groups(graph: ModelGraph, pruned: dict[str, tuple[int, str]], infos: Mapping[str, ParamInfo],
                    input_groups: Callable[[str], int]) -> list[ChannelGroup]:
    def canonical(name: str) -> tuple[int, ...]:
        info = infos[name]
        return tuple(info.shape[a] for a in info.kernel_axes) if info.kernel_axes else tuple(info.shape)

    out = []
    for att, modifier in head_groups(graph.attentions, pruned):
        width = att.widths()[att.output]  # the output projection's input columns a unit holds
        group = input_groups(att.output)
        block = group // width if group > width and group % width == 0 and att.kv_heads % (group // width) == 0 else 1
        if att.kv_heads // block < 2:
            raise CouplingError(
                f"{att.name}: mask_type head: its {att.heads} heads are one unit (they share "
                f"{'one key/value head' if att.kv_heads == 1 else 'one group of the output projection scales'}), "
                "and an attention keeps one unit, so none can be removed; leave this attention out of params",
                modifier)
        out.append(ChannelGroup(modifier, "head", att.widths(), tuple(b for _, b in att.biases), att.kv_heads,
                                frozenset({att.output}), att.bias_widths(), block))
    per_channel = {w: v for w, v in pruned.items() if v[1] != "head"}
    for space, kind, members in pruning_groups(graph.spaces, per_channel) if per_channel else []:
        if kind == "filter":
            channels = canonical(members[0].weight)[0]
            widths = {m.weight: 1 for m in members}
        else:
            direct = [c.weight for c, per in space.consumers if per == 1]
            channels = canonical(direct[0])[1] if direct else canonical(space.producers[0].weight)[0]
            widths = {c.weight: 1 if per == 1 else canonical(c.weight)[1] // channels for c, per in space.consumers}
        followers = tuple(followers_of(space)) if kind == "filter" else ()
        block = 1
        if kind == "filter":  # weight-only readers in groups: whole groups of channels (all readers' groups)
            for consumer, per in space.consumers:
                group = input_groups(consumer.weight) if per == 1 else 1
                block = block * group // math.gcd(block, group)
            block = block if channels % block == 0 else 1
        out.append(ChannelGroup(pruned[members[0].weight][0], kind, widths, followers, channels, block=block))
    return out
