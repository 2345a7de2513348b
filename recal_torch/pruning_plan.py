"""The pruning side of a planned recipe (:mod:`recal_torch.precision_plan`): which planned Linear layers share a
channel space thinning can remove (a gated MLP's gate and up projections make its channels, its down projection
reads them), and the loss increase of each space pruned alone at each level.

Spaces come from recal's channel tracing, the graph ``mask_type: filter`` prunes and ``thin`` removes, traced as
``modify`` traces it (on the calibration batch's own call where only that works). A space is a candidate when
every layer making it and every layer reading it is a planned layer and its readers read one feature a channel;
what follows its channels between them (a BatchNorm, a depthwise convolution: planned too, thinned on both sides)
is zeroed with a pruned channel, as the modifier zeroes it. A level is scored with the masks the recipe's ``mask_type:
filter`` modifier will compute (:func:`recal_torch.pruning.group_masks` on the core's
:class:`~recal_core.model_plan.ChannelGroup`, the count by :func:`recal_core.schedules.pruned_count`): whole blocks of
the readers' quantization group, the weakest by the producers' summed squared norms.
"""

from __future__ import annotations

from dataclasses import dataclass
import warnings

import torch
from torch import nn

from recal_core.channel_coupling import followers_of
from recal_core.model_plan import ChannelGroup
from recal_core.schedules import pruned_count

from .pruning import expand, group_masks



@dataclass(frozen=True)
class PlanGroup:
    """One prunable channel space of the planned layers."""

    name: str  # its first producer's name
    producers: tuple[str, ...]  # layers making the channels (rows), named in the pruning modifier
    readers: tuple[str, ...]  # layers reading them (columns)
    channels: int
    block: int  # channels pruned together: the readers' quantization group (their planned bits in groups)
    through: tuple[str, ...] = ()  # planned layers between them, one filter a channel (depthwise convolutions)
    followers: tuple[str, ...] = ()  # zeroed with a pruned channel: biases, BatchNorm shifts, depthwise filters

    def pruned(self, level: float) -> int:
        """Channels a modifier at ``level`` prunes (:meth:`recal_core.model_plan.ModelPlan.channel_count`'s rule)."""
        return pruned_count(level, self.channels // self.block) * self.block

    def channel_group(self) -> ChannelGroup:
        """The core's form of it, as a ``mask_type: filter`` modifier on its producers ranks it."""
        return ChannelGroup(0, "filter", {f"{p}.weight": 1 for p in self.producers}, self.followers, self.channels,
                            block=self.block)


def plan_groups(model: nn.Module, linears: dict[str, nn.Linear], example: tuple[tuple, dict],
                group_size: int) -> tuple[list[PlanGroup], str]:
    """The prunable channel spaces of ``linears`` in ``model`` traced on ``example`` (``(args, kwargs)`` of one
    call), and why none were found ('' when some were)."""
    from .tracing import model_graph

    try:  # the graph modify() and thin() trace by default, so that the recipe prunes what the plan measured
        graph = model_graph(model)
    except Exception:  # noqa: BLE001 - fx cannot trace it and recal knows no inputs for it: the calibration call
        try:
            graph = model_graph(model, example)
        except Exception as exc:  # noqa: BLE001 - a model recal cannot trace is planned without pruning, said
            return [], f"recal cannot trace {type(model).__name__}'s channels ({type(exc).__name__}: {exc})"[:300]
        warnings.warn(f"{type(model).__name__}: its channels were traced on the calibration batch (torch.fx cannot "
                      "trace it): train the planned recipe with modify(..., example_inputs=<a batch>) so that its "
                      "pruning traces the same", stacklevel=4)
    layer_of = {f"{name}.weight": name for name in linears}
    groups = []
    for space in graph.spaces:
        producers = [layer_of.get(op.weight) for op in space.producers]
        readers = [layer_of.get(op.weight) for op, _ in space.consumers]
        per_channel = {features for _, features in space.consumers}
        if not space.thinnable or not producers or not readers or None in producers + readers or per_channel != {1}:
            continue
        through = tuple(layer_of[op.weight] for op, _ in space.followers if op.weight in layer_of)
        channels = linears[producers[0]].weight.shape[0]
        block = group_size or 1
        if channels % block == 0 and channels >= 2 * block:
            groups.append(PlanGroup(producers[0], tuple(producers), tuple(readers), channels, block, through,
                                    tuple(followers_of(space))))
    return groups, "" if groups else "no channel space of the planned layers is made and read by them alone"


def group_scores(model: nn.Module, group: PlanGroup, linears: dict[str, nn.Module], levels: tuple[float, ...],
                 batches: list, loss_fn, base: float) -> dict[float, float]:
    """The loss increase on ``batches`` with the group's weakest channels pruned at each level (its producers' rows
    and its followers zeroed there: the channels then carry nothing to their readers), every other layer as it is."""
    weights = {f"{p}.weight": linears[p].weight for p in group.producers}
    tensors = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    zeroed = {name: tensors[name] for name in [*weights, *group.followers] if name in tensors}
    saved = {name: t.detach().clone() for name, t in zeroed.items()}
    scores = {}
    try:
        for level in levels:
            masks = group_masks(group.channel_group(), {n: w.detach() for n, w in weights.items()},
                                group.pruned(level))
            keep = next(iter(masks.values())).reshape(group.channels, -1)[:, 0]
            with torch.no_grad():
                for tensor in zeroed.values():  # as MaskState zeroes them: a channel's rows (its width of them)
                    tensor.mul_(expand(keep, tensor, False, tensor.shape[0] // group.channels))
                scores[level] = sum(float(loss_fn(model, b)) for b in batches) / len(batches) - base
            _restore(zeroed, saved)
    finally:
        _restore(zeroed, saved)
    return scores


def _restore(tensors: dict[str, torch.Tensor], saved: dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for name, value in saved.items():
            tensors[name].copy_(value)
