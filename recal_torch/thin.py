"""Thinning: remove the channels filter or channel pruning left dead, so the model (and its ONNX export,
QDQ or int8) does fewer multiply-adds, not only more zeros.

A channel of a thinnable space (:mod:`recal_core.channel_coupling`) is dead when it is exactly zero (every
producer's filter and bias zero, every BatchNorm on the way has zero shift and running mean, every
depthwise conv a zero bias) or when no consumer reads it (every consumer's input columns zero). Removing
it from the producers, the per-channel tensors on the way and the consumers' inputs leaves the outputs as
they were (a test checks it on residual, depthwise and flatten-linear nets, float and QAT).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from recal_core.channel_coupling import Space

from .channel_graph import model_spaces
from .qat import QATModule, WeightFakeQuantize

_BN_TENSORS = ("weight", "bias", "running_mean", "running_var")


@dataclass(frozen=True)
class ThinReport:
    """What :func:`thin` removed: per space, its producers and ``(channels before, after)``."""

    spaces: tuple[tuple[tuple[str, ...], int, int], ...]

    @property
    def removed(self) -> int:
        return sum(before - after for _, before, after in self.spaces)

    def __str__(self) -> str:
        rows = [f"{', '.join(p)}: {b} -> {a} channels" for p, b, a in self.spaces if a < b]
        return "\n".join(rows) or "no dead channels"


@torch.no_grad()
def thin(model: nn.Module) -> ThinReport:
    """Remove ``model``'s dead channels in place (call it after training: the optimizer and the manager
    hold the old tensors). Spaces the coupling rules cannot thin are left as they are."""
    modules = dict(model.named_modules())
    done = []
    for space in model_spaces(model):
        if not space.thinnable:
            continue
        keep = _live_channels(space, modules)
        before = int(keep.numel())
        if bool(keep.all()):
            continue
        if not bool(keep.any()):
            keep[0] = True  # a layer needs one channel; a zero one computes the same
        index = keep.nonzero().flatten()
        for op in space.producers:
            _slice_out(modules[op.name], index)
        for op, _ in space.followers:
            m = modules[op.name]
            if op.kind == "depthwise":
                _slice_out(m, index)
                m.groups = len(index)
                if hasattr(m, "in_channels"):
                    m.in_channels = len(index)
            else:
                for attr in _BN_TENSORS:
                    _slice_attr(m, attr, index, 0)
                m.num_features = len(index)
        for op, width in space.consumers:
            m = modules[op.name]
            per = 1 if width == 1 else m.weight.shape[1] // before
            cols = (index[:, None] * per + torch.arange(per, device=index.device)).flatten()
            _slice_attr(m, "weight", cols, 1)
            if hasattr(m, "in_channels"):
                m.in_channels = len(cols)
            if hasattr(m, "in_features"):
                m.in_features = len(cols)
        done.append((tuple(p.name for p in space.producers), before, len(index)))
    return ThinReport(tuple(done))


def _rows_zero(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else (t.reshape(t.shape[0], -1) == 0).all(1)


def _live_channels(space: Space, modules: dict[str, nn.Module]) -> torch.Tensor:
    """``True`` for the channels that are neither exactly zero nor unread."""
    zero = None
    for op in space.producers:
        m = modules[op.name]
        z = _rows_zero(m.weight)
        if m.bias is not None:
            z = z & (m.bias == 0)
        zero = z if zero is None else zero & z
    for op, _ in space.followers:
        m = modules[op.name]
        tensors = [getattr(m, "bias", None)] + ([getattr(m, "running_mean", None)] if op.kind == "norm" else [])
        for t in tensors:
            if t is not None:
                zero = zero & (t == 0)
    unread = None
    channels = zero.numel()
    for op, width in space.consumers:
        w = modules[op.name].weight
        per = 1 if width == 1 else w.shape[1] // channels
        cols = w.transpose(0, 1).reshape(channels, -1) if per == 1 else \
            w.reshape(w.shape[0], channels, per, *w.shape[2:]).transpose(0, 1).reshape(channels, -1)
        u = (cols == 0).all(1)
        unread = u if unread is None else unread & u
    dead = zero if unread is None else zero | unread
    return ~dead


def _slice_attr(m: nn.Module, attr: str, index: torch.Tensor, dim: int) -> None:
    t = getattr(m, attr, None)
    if t is None:
        return
    new = t.index_select(dim, index).clone()
    if isinstance(t, nn.Parameter):
        setattr(m, attr, nn.Parameter(new, requires_grad=t.requires_grad))
    else:
        setattr(m, attr, new)


def _slice_out(m: nn.Module, index: torch.Tensor) -> None:
    """A conv or linear (float or QAT) down to the output channels ``index``."""
    for attr in ("weight", "bias"):
        _slice_attr(m, attr, index, 0)
    if hasattr(m, "out_channels"):
        m.out_channels = len(index)
    if hasattr(m, "out_features"):
        m.out_features = len(index)
    if isinstance(m, QATModule):
        fq: WeightFakeQuantize = m.weight_fake_quant
        _slice_attr(fq, "scale", index, 0)
        _slice_attr(fq, "zero_point", index, 0)
