"""The manager's own checkpoint state: its version, and the checks a checkpoint passes before anything changes."""

from __future__ import annotations

from typing import Any

from recal_core import load_recipe
from recal_core.recipe import Recipe

STATE_VERSION = 2


def check_state(state: Any, recipe: Recipe, steps_per_epoch: int) -> int:
    """The step ``state`` (:meth:`~recal_torch.manager.ScheduledModifierManager.state_dict`) was taken at, once its
    version, keys, recipe and step count fit this run; ``ValueError`` saying what does not fit otherwise.

    Args:
        state: what the manager's ``state_dict`` returned, read from a checkpoint.
        recipe: this manager's recipe.
        steps_per_epoch: this run's.
    """
    if not isinstance(state, dict) or state.get("version") != STATE_VERSION:
        found = state.get("version") if isinstance(state, dict) else type(state).__name__
        raise ValueError(f"unsupported recal state version {found!r} (this recal writes {STATE_VERSION})")
    missing = [k for k in ("recipe", "steps_per_epoch", "step", "group_bases", "original_trainable", "masks",
                           "qat_prepared") if k not in state]
    if missing:
        raise ValueError(f"the recal state lacks {', '.join(missing)}")
    if load_recipe(state["recipe"]) != recipe:
        raise ValueError("the checkpoint was taken under a different recipe than this manager's")
    if state["steps_per_epoch"] != steps_per_epoch:
        raise ValueError(f"the checkpoint used steps_per_epoch={state['steps_per_epoch']}, "
                         f"this run {steps_per_epoch}")
    step = state["step"]
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"the checkpoint's step is {step!r}, not a step count")
    return step
