"""Parameters that FSDP2 (``torch.distributed.fsdp.fully_shard``) holds as DTensors, each rank one shard.

recal decides on whole tensors and writes in the parameter's own layout: a mask is ranked on the full weight
(gathered on every rank, so every rank computes the same mask, the one the unsharded run computes) and kept as a
DTensor of the parameter's placements, so applying it, and masking gradients, touch only the local shard.
Checkpoints hold whole masks, so a sharded run and a single-process run resume from each other's state.
"""

from __future__ import annotations

import torch

if torch.distributed.is_available():  # a build without distributed has no DTensor (and nothing sharded)
    from torch.distributed.tensor import DTensor as _DTensor
else:
    _DTensor = None


def is_sharded(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a DTensor (FSDP2's parameters and gradients)."""
    return _DTensor is not None and isinstance(tensor, _DTensor)


def gathered(own: torch.Tensor | None, source: torch.nn.Module, name: str) -> torch.Tensor | None:
    """The tensor a layer that adopted ``source``'s parameter ``name`` (a QAT layer, a folded BatchNorm) computes
    with: ``own``, or, where FSDP2 shards it, the gathered one ``fully_shard`` puts on ``source`` (the module it
    recorded) for each forward of the block holding it."""
    if own is None or not is_sharded(own):
        return own
    live = getattr(source, name, None)
    if live is None or is_sharded(live):
        raise RuntimeError(f"{type(source).__name__}.{name} is still sharded in forward: FSDP2 gathers a layer's "
                           "parameters in the forward of the module fully_shard wrapped; shard the block holding "
                           "this layer, not the layer QAT replaced")
    return live


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


_MODULE_STATE = ("_parameters", "_buffers", "_modules", "_non_persistent_buffers_set")
_SHARDED_CLASSES: dict[tuple[type, type], type] = {}


def take_over(unit: torch.nn.Module, replacement: torch.nn.Module) -> torch.nn.Module:
    """Make ``unit``, a layer ``fully_shard`` wrapped itself, into ``replacement`` (its QAT layer, which adopted its
    Parameters) in place, and return it.

    FSDP2 keeps a unit's state and hooks on the instance and gathers its parameters onto that instance in the
    unit's own forward (HF ``Trainer`` and accelerate shard the embeddings and the LM head this way), so a new module
    in its place would compute with shards. ``unit`` keeps its hooks and FSDP2 state and takes ``replacement``'s
    class, children, buffers and attributes: the forward that gathers is now the QAT layer's."""
    from torch.distributed.fsdp import FSDPModule

    key = (type(unit), type(replacement))
    if key not in _SHARDED_CLASSES:  # as fully_shard names its classes, with its refusal to deep-copy
        extra = {k: v for k, v in vars(type(unit)).items() if k == "__deepcopy__"}
        _SHARDED_CLASSES[key] = type(f"FSDP{type(replacement).__name__}", (FSDPModule, type(replacement)), extra)
    for name, value in vars(replacement).items():
        if name in _MODULE_STATE or not name.startswith("_"):
            unit.__dict__[name] = value
    object.__setattr__(unit, "adopted_from", unit)
    unit.__class__ = _SHARDED_CLASSES[key]
    return unit


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


def forward_to_trace(module: torch.nn.Module, forward):
    """What a ``torch.fx`` tracer calls for ``module``: a module ``fully_shard`` wrapped runs its own class's forward,
    without FSDP2's hooks around it (they gather weights, and the root's first one inspects the inputs, which a
    trace cannot give it)."""
    return type(module).forward.__get__(module) if is_sharded_module(module) else forward
