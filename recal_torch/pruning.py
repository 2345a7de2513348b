"""Unstructured magnitude masks for torch parameters, exact to the target count."""

from __future__ import annotations

import torch

from recal_core.schedules import pruned_count


@torch.no_grad()
def magnitude_mask(weight: torch.Tensor, sparsity: float) -> torch.Tensor:
    """A 0/1 mask (weight's dtype) that zeroes exactly ``pruned_count(sparsity, n)`` smallest-magnitude weights.

    Ties are broken by flat index (a stable sort), so every process computes the same mask.
    """
    count = pruned_count(sparsity, weight.numel())
    mask = torch.ones(weight.numel(), dtype=weight.dtype, device=weight.device)
    if count:
        order = torch.argsort(weight.detach().abs().flatten(), stable=True)
        mask[order[:count]] = 0
    return mask.view_as(weight)


@torch.no_grad()
def nonzero_mask(weight: torch.Tensor) -> torch.Tensor:
    """The mask that keeps an already-pruned weight's zeros (ConstantKS)."""
    return (weight != 0).to(weight.dtype)
