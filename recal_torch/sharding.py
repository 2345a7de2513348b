"""Parameters that FSDP2 (``torch.distributed.fsdp.fully_shard``) holds as DTensors, each rank one shard.

recal decides on whole tensors and writes in the parameter's own layout: a mask is ranked on the full weight
(gathered on every rank, so every rank computes the same mask, the one the unsharded run computes) and kept as a
DTensor of the parameter's placements, so applying it, and masking gradients, touch only the local shard.
Checkpoints hold whole masks, so a sharded run and a single-process run resume from each other's state.
"""

from __future__ import annotations

import torch


def is_sharded(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a DTensor (FSDP2's parameters and gradients)."""
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)


def is_sharded_module(module: torch.nn.Module) -> bool:
    """Whether ``fully_shard`` wrapped ``module`` (its class is then ``FSDP<Layer>``, a subclass of ``FSDPModule``)."""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(module, FSDPModule)


def unsharded_class(module: torch.nn.Module) -> type:
    """The class ``fully_shard`` subclassed (``FSDPLinear`` -> ``Linear``); a module's own class otherwise."""
    from torch.distributed.fsdp import FSDPModule

    if not is_sharded_module(module):
        return type(module)
    return next(c for c in type(module).__mro__[1:] if issubclass(c, torch.nn.Module) and not issubclass(c, FSDPModule))


def whole(tensor: torch.Tensor) -> torch.Tensor:
    """The full tensor (gathered from every rank for a DTensor; ``tensor`` itself otherwise)."""
    return tensor.full_tensor() if is_sharded(tensor) else tensor


def like(full: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """``full`` (the same on every rank) laid out as ``param``: this rank's shard of it for a DTensor, with no
    communication; ``full`` on ``param``'s device otherwise."""
    if is_sharded(param):
        from torch.distributed.tensor import distribute_tensor

        return distribute_tensor(full.to(param.to_local().device), param.device_mesh, param.placements,
                                 src_data_rank=None)
    return full.to(param.device) if full.device != param.device else full
