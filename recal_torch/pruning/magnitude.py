"""Unstructured magnitude masks for torch parameters, exact to the count the core asks for."""

from __future__ import annotations

import torch

from recal_core.mask_layout import MaskLayout


def smallest(values: torch.Tensor, count: int) -> torch.Tensor:
    """A bool tensor marking the ``count`` smallest of the 1-D ``values``, ties by position: what the first ``count``
    of a stable sort would pick, in linear time (a selection, not a sort of millions of weights at each update).

    >>> smallest(torch.tensor([2.0, 1.0, 1.0, 0.5]), 2).tolist()
    [False, True, False, True]
    """
    if count <= 0 or count >= values.numel() or bool(torch.isnan(values).any()):  # NaN sorts last: the sort's order
        picked = torch.zeros(values.numel(), dtype=torch.bool, device=values.device)
        picked[torch.argsort(values, stable=True)[:max(count, 0)]] = True
        return picked
    threshold = values.kthvalue(count).values
    below, tied = values < threshold, values == threshold
    return below | (tied & (tied.cumsum(0) <= count - below.sum()))


@torch.no_grad()
def magnitude_mask(weight: torch.Tensor, count: int) -> torch.Tensor:
    """A 0/1 mask (weight's dtype) that zeroes exactly the ``count`` smallest-magnitude weights.

    Ties are broken by flat index (a stable sort), so every process computes the same mask.

    >>> magnitude_mask(torch.tensor([3.0, -1.0, 2.0, 1.0]), 2).tolist()
    [1.0, 0.0, 1.0, 0.0]
    """
    pruned = smallest(weight.detach().abs().flatten(), count)
    return (~pruned).to(weight.dtype).view_as(weight)


@torch.no_grad()
def joint_magnitude_masks(weights: list[torch.Tensor], count: int) -> list[torch.Tensor]:
    """Masks that zero the ``count`` smallest magnitudes across all ``weights`` together (one threshold;
    ties by position in the weights concatenated in order)."""
    flat = torch.cat([w.detach().abs().flatten() for w in weights])
    keep = (~smallest(flat, count)).to(flat.dtype)
    return [part.view_as(w).to(w.dtype) for part, w in zip(keep.split([w.numel() for w in weights]), weights)]


@torch.no_grad()
def structured_mask(weight: torch.Tensor, layout: MaskLayout, count: int,
                    kernel_axes: tuple[int, ...]) -> torch.Tensor:
    """The mask of a structured ``layout`` (:mod:`recal_core.mask_layout`) zeroing ``count`` groups (N:M:
    weights of every run), ranked by the layout's score with ties by group position, in ``weight``'s own
    axis order (``kernel_axes`` takes it to the canonical ``[out, in, *spatial]``)."""
    canonical = to_canonical(weight.detach(), kernel_axes)
    view = canonical.permute(*layout.perm).reshape(layout.rows, layout.cols).abs()
    if layout.n_of_m is not None:
        runs = view.reshape(-1, layout.n_of_m[1])
        keep = torch.ones_like(runs)
        if count:
            order = torch.argsort(runs, dim=1, stable=True)[:, :count]
            keep.scatter_(1, order, 0.0)
        mask_view = keep.reshape(layout.rows, layout.cols)
    else:
        tiles = view.reshape(layout.rows // layout.group_rows, layout.group_rows,
                             layout.cols // layout.group_cols, layout.group_cols)
        scores = tiles.pow(2).sum(dim=(1, 3)).sqrt() if layout.score == "l2" else tiles.mean(dim=(1, 3))
        flat = (~smallest(scores.flatten(), count)).to(weight.dtype)
        mask_view = flat.reshape(scores.shape)[:, None, :, None].expand_as(tiles).reshape(layout.rows, layout.cols)
    permuted = mask_view.reshape([canonical.shape[a] for a in layout.perm])
    canonical_mask = permuted.permute(*_inverse(layout.perm))
    return to_canonical(canonical_mask, kernel_axes, back=True).contiguous().to(weight.dtype)


def to_canonical(tensor: torch.Tensor, kernel_axes: tuple[int, ...], back: bool = False) -> torch.Tensor:
    """``tensor``, laid out as its parameter, in the canonical ``[out, in, *spatial]`` order ``kernel_axes`` gives
    (a transformers Conv1D or a transposed conv stores its inputs first), or ``back`` from it."""
    return tensor.permute(*(_inverse(kernel_axes) if back else kernel_axes))


def _inverse(perm: tuple[int, ...]) -> list[int]:
    out = [0] * len(perm)
    for i, p in enumerate(perm):
        out[p] = i
    return out


@torch.no_grad()
def nonzero_mask(weight: torch.Tensor) -> torch.Tensor:
    """The mask that keeps an already-pruned weight's zeros (ConstantKS)."""
    return (weight != 0).to(weight.dtype)
