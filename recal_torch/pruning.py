"""Unstructured magnitude masks for torch parameters, exact to the count the core asks for."""

from __future__ import annotations

import torch


@torch.no_grad()
def magnitude_mask(weight: torch.Tensor, count: int) -> torch.Tensor:
    """A 0/1 mask (weight's dtype) that zeroes exactly the ``count`` smallest-magnitude weights.

    Ties are broken by flat index (a stable sort), so every process computes the same mask.

    >>> magnitude_mask(torch.tensor([3.0, -1.0, 2.0, 1.0]), 2).tolist()
    [1.0, 0.0, 1.0, 0.0]
    """
    mask = torch.ones(weight.numel(), dtype=weight.dtype, device=weight.device)
    if count:
        order = torch.argsort(weight.detach().abs().flatten(), stable=True)
        mask[order[:count]] = 0
    return mask.view_as(weight)


@torch.no_grad()
def nonzero_mask(weight: torch.Tensor) -> torch.Tensor:
    """The mask that keeps an already-pruned weight's zeros (ConstantKS)."""
    return (weight != 0).to(weight.dtype)
