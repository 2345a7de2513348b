"""The tensor work of channel-coupled filter and channel masks: the core's :class:`ChannelGroup` (which
layers rank their channels together, how many channels go, which tensors follow) applied to PyTorch
weights, so a pruned channel is exactly zero and :func:`recal_torch.thin` can remove it."""

from __future__ import annotations

import torch

from recal_core.model_plan import ChannelGroup


def _channel_view(weight: torch.Tensor, kind: str, width: int) -> torch.Tensor:
    """``weight`` as ``[channels, rest]``: its rows (filter), or its input channels (channel)."""
    if kind == "filter":
        return weight.flatten(1)
    w = weight.transpose(0, 1)  # [in, out, ...]
    return w.reshape(w.shape[0] // width, -1)


@torch.no_grad()
def group_masks(group: ChannelGroup, weights: dict[str, torch.Tensor], count: int) -> dict[str, torch.Tensor]:
    """Each member's mask: the group's ``count`` channels of least summed squared norm (ties by position)
    zeroed in every member."""
    score = sum(_channel_view(weights[n], group.kind, w).pow(2).sum(1) for n, w in group.members.items())
    keep = torch.ones(group.channels, device=score.device)
    keep[torch.argsort(score, stable=True)[:count]] = 0
    return {name: expand(keep, weights[name], group.kind, width) for name, width in group.members.items()}


def expand(keep: torch.Tensor, like: torch.Tensor, kind: str, width: int = 1) -> torch.Tensor:
    """A per-channel ``keep`` vector as a mask of ``like`` (along its first axis for filters and followers,
    its second, ``width`` features per channel, for channel groups)."""
    if kind == "filter" or like.dim() == 1:
        return keep.reshape(-1, *([1] * (like.dim() - 1))).expand_as(like).to(like.dtype).contiguous()
    cols = keep.repeat_interleave(width)
    return cols.reshape(1, -1, *([1] * (like.dim() - 2))).expand_as(like).to(like.dtype).contiguous()
