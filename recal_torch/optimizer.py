"""The optimizer returned by ``manager.modify``: the user's optimizer with recal around ``step``.

It is a ``torch.optim.Optimizer`` (LR schedulers accept it) that shares the wrapped
optimizer's ``param_groups``, ``state`` and ``defaults`` and delegates everything else; only
``step`` (masks and schedules around it) and ``state_dict`` / ``load_state_dict`` (recal's
state under the key ``"recal"``) differ.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import torch

if TYPE_CHECKING:
    from .manager import ScheduledModifierManager

RECAL_STATE_KEY = "recal"


class RecalOptimizer(torch.optim.Optimizer):
    """Wraps ``optimizer``; ``step()`` masks gradients, steps, re-applies masks and advances the schedule."""

    def __init__(self, optimizer: torch.optim.Optimizer, manager: ScheduledModifierManager):
        # Optimizer.__init__ is not called: groups, state and hooks are the wrapped optimizer's.
        self.__dict__["_optimizer"] = optimizer
        self.__dict__["_manager"] = manager

    # --- shared attributes -------------------------------------------------------------------
    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self._optimizer

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return self._optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self._optimizer.param_groups = value

    @property
    def state(self):  # type: ignore[override]
        return self._optimizer.state

    @state.setter
    def state(self, value) -> None:
        self._optimizer.state = value

    @property
    def defaults(self) -> dict[str, Any]:  # type: ignore[override]
        return self._optimizer.defaults

    @defaults.setter
    def defaults(self, value: dict[str, Any]) -> None:
        self._optimizer.defaults = value

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["_optimizer"], name)

    def __repr__(self) -> str:
        return f"RecalOptimizer({self._optimizer!r})"

    # --- what recal changes ---------------------------------------------------------------------
    def step(self, closure: Callable[[], float] | None = None):  # type: ignore[override]
        self._manager._before_optimizer_step()
        loss = self._optimizer.step(closure) if closure is not None else self._optimizer.step()
        self._manager._after_optimizer_step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._optimizer.zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self._optimizer.add_param_group(param_group)

    def register_step_pre_hook(self, hook):
        return self._optimizer.register_step_pre_hook(hook)

    def register_step_post_hook(self, hook):
        return self._optimizer.register_step_post_hook(hook)

    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        state = self._optimizer.state_dict()
        state[RECAL_STATE_KEY] = self._manager.state_dict()
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # type: ignore[override]
        state_dict = dict(state_dict)
        recal_state = state_dict.pop(RECAL_STATE_KEY, None)
        if recal_state is not None:
            self._manager.load_state_dict(recal_state)
        self._optimizer.load_state_dict(state_dict)
