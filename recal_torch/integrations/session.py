"""What the framework callbacks share: a manager bound to the framework's optimizer and scheduler, the recipe's
length checked against the run's, and the QAT state of a resumed run filled from the checkpoint.

A framework restores a checkpoint's model weights before the callback can bind the recipe; a run resumed after QAT
began saved quantizer buffers (scales, observer ranges) that the float model does not have yet. Once the manager's
state has re-created the QAT modules, :func:`load_model_state` puts them in, and refuses a checkpoint that does not
fit rather than resume inexactly.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import torch
from torch import nn

from recal_core.errors import RecipeWarning

from ..checkpoint_file import read_checkpoint_file
from ..manager import ScheduledModifierManager
from ..optimizer_hooks import RECAL_STATE_KEY
from ..model_params import check_values, unwrap
from ..qat import quantizer_tensors

QUANTIZER_KEY = "quantizer_tensors"  # beside recal's state where a framework's checkpoint cannot carry them


def manager_of(recipe: str | os.PathLike | ScheduledModifierManager) -> ScheduledModifierManager:
    """A recipe (a path or YAML text) as a fresh manager; a manager as it is."""
    if isinstance(recipe, ScheduledModifierManager):
        return recipe
    return ScheduledModifierManager.from_yaml(recipe)


def inner(wrapped: Any) -> Any:
    """The torch optimizer or scheduler inside accelerate's wrapper (``AcceleratedOptimizer.optimizer``,
    ``AcceleratedScheduler.scheduler``); anything else as it is."""
    if type(wrapped).__module__.split(".")[0] == "accelerate":
        return getattr(wrapped, "scheduler", None) or getattr(wrapped, "optimizer")
    return wrapped


def check_length(manager: ScheduledModifierManager, epochs: float, who: str) -> None:
    """Warn when the run stops before the recipe's last modifier ends: its pruning or QAT would never finish."""
    recipe_epochs = manager.recipe.max_epochs_exact
    if epochs + 1e-9 < recipe_epochs:
        warnings.warn(f"the recipe runs {recipe_epochs:g} epochs, but {who} trains {epochs:g}: the modifiers still "
                      "running at the end do not reach their final values; train as long as the recipe (its "
                      "EpochRangeModifier), or shorten the recipe", RecipeWarning, stacklevel=3)


def load_model_state(model: nn.Module, state: dict[str, torch.Tensor], where: str) -> None:
    """Load a checkpoint's model tensors once the resumed recipe has re-created its QAT modules; a tensor the
    model lacks, or one the checkpoint lacks, is an error that names them (a tied weight the checkpoint saved once,
    as Hugging Face's safetensors do, is not missing), and so is a quantizer tensor of another shape or a NaN scale.
    """
    if not isinstance(state, dict):
        raise ValueError(f"{where}: the model weights are a {type(state).__name__}, not a state dict")
    check_values(state, quantizer_tensors(unwrap(model)), where)
    result = unwrap(model).load_state_dict(state, strict=False)
    own = unwrap(model).state_dict(keep_vars=True)
    present = {own[k].data_ptr() for k in own if k in state}
    missing = [k for k in result.missing_keys if own[k].data_ptr() not in present]  # not a tied alias (an LM head)
    _refuse_misfit(where, result.unexpected_keys, missing)


def read_recal_part(path: str | os.PathLike) -> dict[str, Any]:
    """A checkpoint's ``recal_state.pt`` (:func:`read_checkpoint_file`); one that is not recal's part is a
    ``ValueError`` naming it."""
    part = read_checkpoint_file(path, "recal state file")
    if not isinstance(part, dict) or not isinstance(part.get(QUANTIZER_KEY), dict):
        found = sorted(map(str, part))[:5] if isinstance(part, dict) else type(part).__name__
        raise ValueError(f"{path} is not recal's part of a checkpoint: it holds {found}, not recal's state with "
                         f"its {QUANTIZER_KEY!r}")
    return part


def recal_part(optimizer: torch.optim.Optimizer, model: nn.Module) -> dict[str, Any]:
    """What a framework's checkpoint must carry for recal where its optimizer file cannot (FSDP's keep only the
    optimizer's own keys): recal's state, its learned scales' param groups and the quantizer tensors. Call it on
    every rank: a sharded model's masks are gathered whole."""
    return {**optimizer.state_dict()[RECAL_STATE_KEY], QUANTIZER_KEY: quantizer_tensors(unwrap(model))}


def restore_recal_part(optimizer: torch.optim.Optimizer, loaded: dict[str, Any], part: dict[str, Any],
                       manager: ScheduledModifierManager, model: nn.Module, where: str) -> None:
    """:func:`recal_part` back, after the framework restored the weights and the optimizer (``loaded``: the user's
    param groups as it loaded them): recal's state through its hook (QAT layers re-created, the learned scales'
    groups with their state), then the quantizer tensors into those layers."""
    if not isinstance(part, dict) or not isinstance(part.get(QUANTIZER_KEY), dict):
        raise ValueError(f"{where} holds no recal state with its {QUANTIZER_KEY!r}")
    part = dict(part)
    tensors = part.pop(QUANTIZER_KEY)
    try:
        optimizer.load_state_dict({**loaded, RECAL_STATE_KEY: part})
    except (ValueError, TypeError, KeyError, RuntimeError) as exc:  # the manager's and torch's, naming no file
        raise ValueError(f"{where}: recal's state in it does not resume this run: {exc}") from exc
    if manager.qat.prepared:
        own = quantizer_tensors(unwrap(model))
        _refuse_misfit(where, sorted(tensors.keys() - own.keys()), sorted(own.keys() - tensors.keys()))
        check_values(tensors, own, where)
        unwrap(model).load_state_dict(tensors, strict=False)


def _refuse_misfit(where: str, extra: list[str], missing: list[str]) -> None:
    """The error for a checkpoint whose tensors do not fit the model: the first names of either side."""
    if extra or missing:
        parts = [f"the model has no {', '.join(extra[:5])}" if extra else "",
                 f"the checkpoint has no {', '.join(missing[:5])}" if missing else ""]
        raise ValueError(f"{where} does not fit the model under this recipe: {'; '.join(p for p in parts if p)} "
                         "(was it saved under another recipe or model?)")
