"""The tensor work of channel-coupled filter and channel masks: the core's :class:`ChannelGroup` (which
layers rank their channels together, how many channels go, which tensors follow) applied to PyTorch
weights, so a pruned channel is exactly zero and :func:`recal_torch.thin` can remove it."""

from __future__ import annotations

import torch

from recal_core.head_coupling import Width
from recal_core.model_plan import ChannelGroup

from .magnitude import smallest


def channel_view(weight: torch.Tensor, along_input: bool, width: Width) -> torch.Tensor:
    """``weight`` (canonical ``[out, in, ...]``) as ``[channels, rest]``: ``width`` rows per channel, or ``width``
    input columns; a packed weight's widths (one per block of rows) gather each channel's rows from every block."""
    w = weight.transpose(0, 1) if along_input else weight  # [in, out, ...] for input columns
    if isinstance(width, int):
        return w.reshape(w.shape[0] // width, -1)
    channels = w.shape[0] // sum(width)
    return torch.cat([block.reshape(channels, -1) for block in w.split([channels * x for x in width])], 1)


@torch.no_grad()
def group_masks(group: ChannelGroup, weights: dict[str, torch.Tensor], count: int) -> dict[str, torch.Tensor]:
    """Each member's mask: the group's ``count`` channels (heads) of least summed squared norm (ties by
    position) zeroed in every member; in whole blocks of ``group.block`` channels, ranked by their sums."""
    score = sum(channel_view(weights[n], group.along_input(n), w).pow(2).sum(1) for n, w in group.members.items())
    block = group.block  # channels ranked and zeroed together (a weight-only reader's quantization group)
    keep = (~smallest(score.reshape(-1, block).sum(1), count // block)).float()
    keep = keep.repeat_interleave(block) if block > 1 else keep
    return {name: expand(keep, weights[name], group.along_input(name), width)
            for name, width in group.members.items()}


def expand(keep: torch.Tensor, like: torch.Tensor, along_input: bool, width: Width = 1) -> torch.Tensor:
    """A per-channel ``keep`` vector as a mask of ``like``: ``width`` elements per channel along its first
    axis (filters, heads' rows, followers; once per block of a packed weight), or along its second (channel
    groups, a head's output columns)."""
    widths = (width,) if isinstance(width, int) else width
    per = torch.cat([keep.repeat_interleave(w) if w > 1 else keep for w in widths])
    if not along_input or like.dim() == 1:
        return per.reshape(-1, *([1] * (like.dim() - 1))).expand_as(like).to(like.dtype).contiguous()
    return per.reshape(1, -1, *([1] * (like.dim() - 2))).expand_as(like).to(like.dtype).contiguous()
