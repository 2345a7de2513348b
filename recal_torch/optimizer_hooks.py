"""The hooks :meth:`~recal_torch.manager.ScheduledModifierManager.modify` registers on the user's optimizer: small
picklable callables that call back into the manager, so the optimizer stays the user's own (``copy.deepcopy``,
``pickle``, ``torch.compile`` and checkpointing behave as they do without recal)."""

from __future__ import annotations

import torch
from torch import nn

from .training import join_learned_groups, split_learned_groups

RECAL_STATE_KEY = "recal"  # recal's part of ``optimizer.state_dict()``


class _Hook:
    def __init__(self, manager):
        self.manager = manager


class StepPreHook(_Hook):
    """Checks the LR and readies the gradients; with a closure (Lightning's, LBFGS's), once the closure computed
    them: before it, they do not exist yet."""

    def __call__(self, optimizer, args, kwargs):
        manager = self.manager  # ``args``: the optimizer itself first, then step()'s own positional arguments
        closure = kwargs.get("closure", args[1] if len(args) > 1 else None)
        manager.param_groups.check_untouched(manager._step)
        if closure is None:
            manager._gradients_ready()
            return None

        def masked_closure():
            with torch.enable_grad():
                loss = closure()
            manager._gradients_ready()
            return loss

        return args[:1], {**{k: v for k, v in kwargs.items() if k != "closure"}, "closure": masked_closure}


class StepPostHook(_Hook):
    def __call__(self, optimizer, args, kwargs):
        self.manager._after_step()


class StateDictHook(_Hook):
    """recal's part under ``"recal"``, its learned scales' param groups with it (the rest: the user's optimizer)."""

    def __call__(self, optimizer, state_dict):
        state_dict, learned = split_learned_groups(state_dict)
        state_dict[RECAL_STATE_KEY] = self.manager.state_dict()
        if learned is not None:
            state_dict[RECAL_STATE_KEY]["learned_groups"] = learned
        return state_dict


def average_gradients(params: list[nn.Parameter]) -> None:
    """Average ``params``' gradients over the ranks of a distributed run: recal's learned scales appear after the
    model was wrapped (DDP reduces only the parameters it found), and every rank must take the same step."""
    if not params or not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return
    world = torch.distributed.get_world_size()
    if world > 1:
        for p in params:
            if p.grad is not None:
                torch.distributed.all_reduce(p.grad)
                p.grad.div_(world)


class LoadStateDictHook(_Hook):
    """Loads recal's part (first: it re-creates QAT modules) and hands the optimizer the rest."""

    def __call__(self, optimizer, state_dict):
        if RECAL_STATE_KEY not in state_dict:
            return None
        rest = {k: v for k, v in state_dict.items() if k != RECAL_STATE_KEY}
        self.manager.load_state_dict(state_dict[RECAL_STATE_KEY])
        learned = state_dict[RECAL_STATE_KEY].get("learned_groups")
        return rest if learned is None else join_learned_groups(rest, learned)
