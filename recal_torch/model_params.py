"""Describe a torch model's parameters to the core (name, layer, prunable)."""

from __future__ import annotations

import torch
from torch import nn

from recal_core.params import ParamInfo

# a QAT module keeps the kernel (or table) of the layer it was built from
from .qat import QATModule, WeightOnlyLinear, is_transposed_linear_type
from .sharding import unsharded_class, whole

PRUNABLE_LAYERS = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d,
                   nn.ConvTranspose3d, nn.Linear)
TABLES = (nn.Embedding, nn.EmbeddingBag)  # pruned only when a recipe names them
UNOBSERVED = ("min_val", "max_val")  # an observer's range, infinite until its first batch


def unwrap(model: nn.Module) -> nn.Module:
    """The model inside a DistributedDataParallel / DataParallel wrapper (or the model itself)."""
    while isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
        model = model.module
    return model


TRANSPOSED = (nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)  # weight [in, out, *k]


def _layer_type(module: nn.Module) -> type:
    """The float layer's class (a QAT or weight-only layer keeps the class of the layer it was made from)."""
    return module.float_type if isinstance(module, (QATModule, WeightOnlyLinear)) else unsharded_class(module)


def is_prunable(module: nn.Module, param_name: str) -> bool:
    kind = _layer_type(module)
    return param_name == "weight" and (issubclass(kind, PRUNABLE_LAYERS) or is_transposed_linear_type(kind))


def is_table(module: nn.Module, param_name: str) -> bool:
    return param_name == "weight" and issubclass(_layer_type(module), TABLES)


def kernel_axes(module: nn.Module, param: torch.Tensor) -> tuple[int, ...]:
    """The axes of a kernel in canonical ``[out, in, *spatial]`` order (transposed convs and transformers'
    Conv1D store in first)."""
    axes = tuple(range(param.dim()))
    transposed = isinstance(module, TRANSPOSED) or is_transposed_linear_type(_layer_type(module))
    return (1, 0, *axes[2:]) if transposed else axes


def describe_parameters(model: nn.Module) -> tuple[list[ParamInfo], dict[str, nn.Parameter]]:
    """Every parameter of ``model`` as a :class:`ParamInfo`, and the Parameter objects by name."""
    infos: list[ParamInfo] = []
    by_name: dict[str, nn.Parameter] = {}
    seen: set[int] = set()
    for layer_name, module in model.named_modules():
        for pname, param in module.named_parameters(recurse=False):
            if id(param) in seen:
                continue  # shared (tied) parameters are selected once, under their first name
            seen.add(id(param))
            full = f"{layer_name}.{pname}" if layer_name else pname
            prunable = is_prunable(module, pname)
            table = is_table(module, pname)
            infos.append(ParamInfo(full, layer_name, prunable, tuple(param.shape),
                                   kernel_axes(module, param) if prunable or table else None,
                                   prunable_when_named=table))
            by_name[full] = param
    return infos, by_name


def sparsity(tensor: torch.Tensor) -> float:
    """The share of exact zeros (of the whole tensor, when FSDP2 shards it)."""
    return float((whole(tensor) == 0).sum().item()) / max(1, tensor.numel())


def check_weights(state: dict, model: nn.Module, where: str) -> None:
    """Refuse (``ValueError``, nothing changed) a state dict whose tensors would not load into ``model`` as they are:
    a missing or extra key, another shape, another dtype (``load_state_dict`` casts int8, float16, bool or complex
    silently), or a non-finite float.

    Args:
        state: the state dict read from a checkpoint.
        model: the model it is for.
        where: the checkpoint's name, for the message.
    """
    own = model.state_dict()
    if not isinstance(state, dict):
        raise ValueError(f"{where}: the model weights are a {type(state).__name__}, not a state dict")
    missing, extra = sorted(set(own) - set(state)), sorted(set(state) - set(own))
    if missing or extra:
        raise ValueError(f"{where}: the model weights do not fit this model (missing {missing[:3]}, "
                         f"unexpected {extra[:3]})")
    check_values(state, own, where)


def check_values(state: dict, own: dict[str, torch.Tensor], where: str) -> None:
    """Refuse (``ValueError``) a tensor of ``state`` that is not what ``own``'s tensor of that name is (another
    shape or dtype: ``load_state_dict`` would cast or fail naming no file) or holds NaN or infinity.

    Args:
        state: the tensors read from a checkpoint (a name ``own`` lacks is not checked here).
        own: the model's tensors they are for, by name.
        where: the checkpoint's name, for the message.
    """
    for key, expected in own.items():
        if key not in state:
            continue
        value = state[key]
        if not isinstance(value, torch.Tensor) or value.shape != expected.shape or value.dtype != expected.dtype:
            got = (f"{value.dtype} {tuple(value.shape)}" if isinstance(value, torch.Tensor)
                   else type(value).__name__)
            raise ValueError(f"{where}: {key!r} is {got}, this model's is {expected.dtype} {tuple(expected.shape)}")
        if value.is_floating_point() and not bool(torch.isfinite(value).all()):
            if key.rpartition(".")[2] in UNOBSERVED and not bool(torch.isnan(value).any()):
                continue  # an observer's range before its first batch: +-infinity by design
            raise ValueError(f"{where}: {key!r} holds non-finite values (NaN or infinity): a diverged run's "
                             "checkpoint; resume from an earlier one")
