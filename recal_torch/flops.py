"""Multiply-adds and parameters of a model, measured by running it once: what thinning saves."""

from __future__ import annotations

import math

import torch
from torch import nn

from .qat import CONVS, QATConv, QATLinear


@torch.no_grad()
def count_macs(model: nn.Module, example: torch.Tensor) -> tuple[int, int]:
    """``(multiply-adds per sample of the conv and linear layers, parameters)`` of ``model`` on ``example``.

    Args:
        model: the model (float, QAT or thinned); run once, without gradients.
        example: one input batch; the count is per sample."""
    total = 0

    def hook(module: nn.Module, inputs: tuple, output: torch.Tensor) -> None:
        nonlocal total
        w = module.weight
        per_output = math.prod(w.shape[1:])  # conv: in/groups x kernel; linear: in_features
        total += output.numel() // output.shape[0] * per_output

    handles = [m.register_forward_hook(hook) for m in model.modules()
               if isinstance(m, (*CONVS, nn.Linear, QATConv, QATLinear))]
    was_training = model.training
    try:
        model.eval()
        model(example)
    finally:
        model.train(was_training)
        for h in handles:
            h.remove()
    return total, sum(p.numel() for p in model.parameters())
