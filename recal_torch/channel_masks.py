"""Filter and channel masks that respect the model's channel coupling (:mod:`recal_core.channel_coupling`):
the layers of one channel space rank their channels together and prune the same ones, and the
per-channel tensors on the way (biases, BatchNorm shifts and running means, depthwise filters) are
zeroed with them, so a pruned channel is exactly zero and :func:`recal_torch.thin` can remove it."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn

from recal_core import Problem
from recal_core.channel_coupling import CouplingError, channel_pruned, followers_of, pruning_groups
from recal_core.model_plan import ModelPlan
from recal_core.recipe import Recipe
from recal_core.schedules import pruned_count

from .channel_graph import model_spaces

log = logging.getLogger(__name__)


@dataclass
class ChannelGroup:
    """Layers pruning the same channels: producers (``filter``) or consumers (``channel``) of one space."""

    kind: str  # "filter" | "channel"
    modifier: int  # the recipe index of the modifier that prunes them
    members: dict[str, int]  # weight name -> features per channel along its pruned axis (1, or S after a flatten)
    followers: list[str]  # tensors zeroed with a pruned channel (filter groups)
    channels: int


def channel_groups(recipe: Recipe, plan: ModelPlan, model: nn.Module) -> tuple[list[ChannelGroup], list[Problem]]:
    """The coupled groups of the plan's filter/channel masks in ``model``, or the problems that stop them."""
    pruned = {name.removesuffix(".weight"): v
              for name, v in channel_pruned({n: p.layouts for n, p in plan.masks.items()}).items()}
    if not pruned:
        return [], []
    try:
        spaces = model_spaces(model)
    except Exception as exc:  # noqa: BLE001 - a model fx cannot trace
        index = next(iter(pruned.values()))[0]
        return [], [recipe.problem(index, "mask_type", f"filter/channel pruning traces {type(model).__name__} "
                                   f"with torch.fx to find the layers that share channels, and it fails: "
                                   f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}",
                                   expected="a model torch.fx can trace, or an unstructured/block mask_type")]
    try:
        found = pruning_groups(spaces, pruned)
    except CouplingError as exc:
        return [], [recipe.problem(exc.modifier, "mask_type", str(exc),
                                   expected="channels every layer sharing them can drop")]
    params = dict(model.named_parameters())
    groups = []
    for space, kind, members in found:
        if kind == "filter":
            channels = params[members[0] + ".weight"].shape[0]
            widths = {m + ".weight": 1 for m in members}
            followers = followers_of(space)
        else:
            channels = params[space.producers[0].weight].shape[0]
            widths = {c.name + ".weight": (1 if per == 1 else params[c.weight].shape[1] // channels)
                      for c, per in space.consumers}
            followers = []
        groups.append(ChannelGroup(kind, pruned[members[0]][0], widths, followers, channels))
    return groups, []


def _channel_view(weight: torch.Tensor, kind: str, width: int) -> torch.Tensor:
    """``weight`` as ``[channels, rest]``: its rows (filter), or its input channels (channel)."""
    if kind == "filter":
        return weight.flatten(1)
    w = weight.transpose(0, 1)  # [in, out, ...]
    return w.reshape(w.shape[0] // width, -1)


@torch.no_grad()
def group_masks(group: ChannelGroup, weights: dict[str, torch.Tensor], sparsity: float) -> dict[str, torch.Tensor]:
    """Each member's mask: the group's ``floor(s * channels + 0.5)`` channels of least summed squared norm
    (ties by position) zeroed in every member."""
    score = sum(_channel_view(weights[n], group.kind, w).pow(2).sum(1) for n, w in group.members.items())
    keep = torch.ones(group.channels, device=score.device)
    keep[torch.argsort(score, stable=True)[: pruned_count(sparsity, group.channels)]] = 0
    return {name: expand(keep, weights[name], group.kind, width) for name, width in group.members.items()}


def expand(keep: torch.Tensor, like: torch.Tensor, kind: str, width: int = 1) -> torch.Tensor:
    """A per-channel ``keep`` vector as a mask of ``like`` (along its first axis for filters and followers,
    its second, ``width`` features per channel, for channel groups)."""
    if kind == "filter" or like.dim() == 1:
        return keep.reshape(-1, *([1] * (like.dim() - 1))).expand_as(like).to(like.dtype).contiguous()
    cols = keep.repeat_interleave(width)
    return cols.reshape(1, -1, *([1] * (like.dim() - 2))).expand_as(like).to(like.dtype).contiguous()
