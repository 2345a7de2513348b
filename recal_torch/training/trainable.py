"""``requires_grad`` of the parameters TrainableParamsModifiers name, as the core's plan says at step ``k``."""

from __future__ import annotations

from typing import Mapping

from torch import nn

from recal_core.model_plan import ModelPlan


class TrainableFlags:
    """Sets the flags whenever the set of TrainableParamsModifiers in force changes."""

    def __init__(self, plan: ModelPlan, params: Mapping[str, nn.Parameter]):
        self.plan = plan
        self.params = {name: params[name] for name in plan.trainable_names}
        self.original = {name: p.requires_grad for name, p in self.params.items()}
        self._rules: tuple[int, ...] | None = None  # the rules last applied

    def apply(self, k: int) -> None:
        rules = self.plan.trainable_rules(k)
        if rules == self._rules:
            return
        self._rules = rules
        for name, flag in self.plan.trainable(k, self.original).items():
            self.params[name].requires_grad_(flag)

    def reset(self, original: Mapping[str, bool]) -> None:
        """Restore the original flags of a checkpoint (applied again at the next :meth:`apply`)."""
        unknown = set(original) - set(self.params)
        if unknown:
            raise ValueError(f"the checkpoint has trainable flags for {sorted(unknown)[:3]}, which this recipe "
                             "does not name in this model")
        self.original.update({name: bool(flag) for name, flag in original.items()})
        self._rules = None
