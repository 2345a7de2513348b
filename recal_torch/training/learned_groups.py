"""recal's own param groups (learned quantization scales) kept apart from the user's in an optimizer's state dict.

The optimizer state a checkpoint holds then has the user's param groups only, as the optimizer they built: a
framework that rebuilds that optimizer and loads the state before recal is back (the Hugging Face Trainer loads
``optimizer.pt`` before any callback runs) takes it as it is, and recal puts its groups and their state back in
their places once it has re-created the scales.
"""

from __future__ import annotations

from typing import Any

LR_FACTOR_KEY = "recal_lr_factor"  # the key recal's param groups carry (their LR as a factor of the first group's)


def split_learned_groups(state_dict: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """An optimizer ``state_dict`` as (the user's groups and their state, recal's groups and theirs, or None)."""
    groups = state_dict.get("param_groups", [])
    positions = [i for i, g in enumerate(groups) if LR_FACTOR_KEY in g]
    if not positions:
        return state_dict, None
    mine = [groups[i] for i in positions]
    ids = {p for g in mine for p in g["params"]}
    state = state_dict.get("state", {})
    theirs = {**state_dict, "param_groups": [g for g in groups if LR_FACTOR_KEY not in g],
              "state": {k: v for k, v in state.items() if k not in ids}}
    return theirs, {"positions": positions, "param_groups": mine,
                    "state": {k: v for k, v in state.items() if k in ids}}


def join_learned_groups(state_dict: dict[str, Any], learned: dict[str, Any]) -> dict[str, Any]:
    """:func:`split_learned_groups` undone: recal's groups back at their places, their state beside the user's."""
    groups = list(state_dict["param_groups"])
    for position, group in zip(learned["positions"], learned["param_groups"]):
        groups.insert(position, group)
    return {**state_dict, "param_groups": groups, "state": {**state_dict.get("state", {}), **learned["state"]}}
