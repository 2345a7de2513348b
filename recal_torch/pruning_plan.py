"""The pruning side of a planned recipe (:mod:`recal_torch.precision_plan`): which planned Linear layers share a
channel space thinning can remove (a gated MLP's gate and up projections make its channels, its down projection
reads them), and the loss increase of each space pruned alone at each level.

Spaces come from recal's channel tracing, the graph ``mask_type: filter`` prunes and ``thin`` removes, traced as
``modify`` traces it (on the calibration batch's own call where only that works). A space is a candidate when
every layer making it and every layer reading it is a planned Linear, its readers read one feature a channel, and
nothing else (a norm, a scale) holds its channels. A level is scored with the masks the recipe's ``mask_type:
filter`` modifier will compute (:func:`recal_torch.pruning.group_masks` on the core's
:class:`~recal_core.model_plan.ChannelGroup`, the count by :func:`recal_core.schedules.pruned_count`): whole blocks of
the readers' quantization group, the weakest by the producers' summed squared norms.
"""

from __future__ import annotations

from dataclasses import dataclass
import warnings
from typing import Any

import torch
from torch import nn

from recal_core.model_plan import ChannelGroup
from recal_core.schedules import pruned_count

from .pruning import group_masks



@dataclass(frozen=True)
class PlanGroup:
    """One prunable channel space of the planned layers."""

    name: str  # its first producer's name
    producers: tuple[str, ...]  # layers making the channels (rows), named in the pruning modifier
    readers: tuple[str, ...]  # layers reading them (columns)
    channels: int
    block: int  # channels pruned together: the readers' quantization group (their planned bits in groups)

    def pruned(self, level: float) -> int:
        """Channels a modifier at ``level`` prunes (:meth:`recal_core.model_plan.ModelPlan.channel_count`'s rule)."""
        return pruned_count(level, self.channels // self.block) * self.block

    def channel_group(self) -> ChannelGroup:
        """The core's form of it, as a ``mask_type: filter`` modifier on its producers ranks it."""
        return ChannelGroup(0, "filter", {f"{p}.weight": 1 for p in self.producers}, (), self.channels,
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
        holders = [tensors for _, tensors in space.followers if tensors]
        if (not space.thinnable or not producers or not readers or None in producers + readers
                or per_channel != {1} or any(t for tensors in holders for t in tensors
                                             if t not in {f"{p}.bias" for p in producers})):
            continue
        channels = linears[producers[0]].out_features
        block = group_size or 1
        if channels % block == 0 and channels >= 2 * block:
            groups.append(PlanGroup(producers[0], tuple(producers), tuple(readers), channels, block))
    return groups, "" if groups else "no channel space of the planned layers is made and read by them alone"


def group_scores(model: nn.Module, group: PlanGroup, linears: dict[str, nn.Linear], levels: tuple[float, ...],
                 batches: list, loss_fn, base: float) -> dict[float, float]:
    """The loss increase on ``batches`` with the group's weakest channels pruned at each level (its producers' rows
    and biases zeroed: the channels then carry nothing to their readers), every other layer as it is."""
    weights = {f"{p}.weight": linears[p].weight for p in group.producers}
    saved = {p: (linears[p].weight.detach().clone(),
                 None if linears[p].bias is None else linears[p].bias.detach().clone()) for p in group.producers}
    scores = {}
    try:
        for level in levels:
            masks = group_masks(group.channel_group(), {n: w.detach() for n, w in weights.items()},
                                group.pruned(level))
            with torch.no_grad():
                for p in group.producers:
                    mask = masks[f"{p}.weight"]
                    linears[p].weight.mul_(mask)
                    if linears[p].bias is not None:
                        linears[p].bias.mul_(mask[:, 0])
                scores[level] = sum(float(loss_fn(model, b)) for b in batches) / len(batches) - base
            _restore(linears, saved)
    finally:
        _restore(linears, saved)
    return scores


def _restore(linears: dict[str, nn.Linear], saved: dict[str, Any]) -> None:
    with torch.no_grad():
        for name, (weight, bias) in saved.items():
            linears[name].weight.copy_(weight)
            if bias is not None:
                linears[name].bias.copy_(bias)
