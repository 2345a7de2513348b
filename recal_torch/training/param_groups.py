"""The LR and weight decay of each optimizer param group, set from the core's plan after every step.

The recipe owns a group's LR once one of its LR modifiers has started. A torch LR scheduler (or
any code) that changes that LR afterwards would silently compound with the recipe's value, so the
next step refuses it with a message that says what to do. A training framework's own scheduler (the Hugging Face
``Trainer``'s, Lightning's) is instead made to follow the recipe (:func:`follow_recipe`), so that what the framework
logs and checkpoints is the LR each step used.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from recal_core.model_plan import GroupPlan

from .learned_groups import LR_FACTOR_KEY


def group_bases(optimizer: torch.optim.Optimizer) -> list[tuple[float | None, float | None]]:
    """Each param group's own ``(lr, weight_decay)``, as the core's plan takes them."""
    return [(_number(g.get("lr")), _number(g.get("weight_decay"))) for g in optimizer.param_groups]


def _number(value) -> float | None:
    if isinstance(value, torch.Tensor):
        return float(value)
    return None if value is None else float(value)


class ParamGroupSettings:
    """Sets ``lr`` and ``weight_decay`` of every param group at step ``k``."""

    def __init__(self, optimizer: torch.optim.Optimizer, plans: list[GroupPlan]):
        if len(plans) != len(optimizer.param_groups):
            raise ValueError(f"{len(plans)} group plans for {len(optimizer.param_groups)} param groups")
        for g, (group, plan) in enumerate(zip(optimizer.param_groups, plans)):
            if "weight_decay" not in group and plan.weight_decay(2**62) is not None:
                raise ValueError(f"the recipe sets the weight decay of param group {g}, but "
                                 f"{type(optimizer).__name__} has no weight_decay; remove the "
                                 "SetWeightDecayModifier or name other param_groups")
        self.optimizer = optimizer
        self.plans = plans
        self.recipe_lrs: list[float | None] = [None] * len(plans)  # the LR recal last set, per group

    def check_untouched(self, k: int) -> None:
        """Raise if a group's LR is no longer the one the recipe set (an LR scheduler on the same optimizer)."""
        for g, (group, expected) in enumerate(zip(self.optimizer.param_groups, self.recipe_lrs)):
            # a scheduler that follows the recipe computes base * (lr / base): equal to within rounding
            if expected is not None and abs(float(group["lr"]) - expected) > 1e-9 * abs(expected):
                raise RuntimeError(
                    f"param group {g}'s lr is {float(group['lr']):.6g}, but recal's recipe set it to {expected:.6g} "
                    f"at step {k}: something else changed it (a torch LR scheduler?). The recipe's LR modifiers own "
                    "the LR while they run; use either them or a torch LR scheduler, not both")

    def apply(self, k: int) -> None:
        for g, (group, plan) in enumerate(zip(self.optimizer.param_groups, self.plans)):
            lr = plan.lr(k)
            if lr is not None:
                _set(group, "lr", lr)
                self.recipe_lrs[g] = lr
            wd = plan.weight_decay(k)
            if wd is not None:
                _set(group, "weight_decay", wd)
        first = self.optimizer.param_groups[0]
        for group in self.optimizer.param_groups[len(self.plans):]:  # recal's own (learned scales): a factor of
            if LR_FACTOR_KEY in group:  # the first group's LR, wherever the recipe or the user moves it
                _set(group, "lr", float(first["lr"]) * group[LR_FACTOR_KEY])


def _set(group: dict, key: str, value: float) -> None:
    current = group[key]
    if isinstance(current, torch.Tensor):  # tensor LRs (capturable / compiled optimizers) stay tensors
        current.fill_(value)
    else:
        group[key] = value


def schedule_added_group(scheduler, index: int, lr_factor: float) -> None:
    """A param group added to the optimizer after ``scheduler`` was made (recal's learned scales, at ``index``):
    stepped on the first group's schedule, from ``lr_factor`` times its base LR (an LR scheduler steps every group
    and fails on one it has no base for)."""
    group = scheduler.optimizer.param_groups[index]
    group["initial_lr"] = float(scheduler.base_lrs[0]) * lr_factor
    scheduler.base_lrs[index:] = [group["initial_lr"]]  # (a resumed scheduler's state may list it already)
    if hasattr(scheduler, "lr_lambdas"):  # a plain function: LambdaLR's state dict leaves it out
        scheduler.lr_lambdas[index:] = [lambda k, first=scheduler.lr_lambdas[0]: first(k)]


def follow_recipe(scheduler, plans: list[GroupPlan], step: Callable[[], int]) -> None:
    """Make a ``LambdaLR`` (what Hugging Face's ``Trainer`` and most training frameworks build) give each group the
    recipe's LR at every step where the recipe sets one, and its own schedule elsewhere.

    The recipe's LR is read at the manager's ``step()``, not at the scheduler's count (accelerate steps a
    scheduler once per process). The new factors are plain functions, which ``LambdaLR.state_dict`` leaves out: a
    checkpoint holds nothing of recal's in the scheduler, and a resumed run follows the recipe from its own plan."""
    from torch.optim.lr_scheduler import LambdaLR

    if not isinstance(scheduler, LambdaLR):
        raise TypeError(f"the recipe sets the LR, and recal can make a LambdaLR follow it, but this optimizer's "
                        f"scheduler is a {type(scheduler).__name__}: leave the LR to one of them (remove the recipe's "
                        "LR modifiers, or use a LambdaLR-based schedule such as the Trainer's defaults)")
    if len(scheduler.lr_lambdas) != len(plans):
        raise ValueError(f"the scheduler has {len(scheduler.lr_lambdas)} LR factors for {len(plans)} param groups")
    for g, (plan, own, base) in enumerate(zip(plans, list(scheduler.lr_lambdas), scheduler.base_lrs)):
        if not base:
            raise ValueError(f"param group {g}'s scheduler starts from LR {base}: no factor of it gives the "
                             "recipe's LR")

        def factor(k: int, plan=plan, own=own, base=base) -> float:
            lr = plan.lr(step())
            return own(k) if lr is None else lr / base

        scheduler.lr_lambdas[g] = factor
