"""The masks of a model's pruned parameters: recomputed when the core's plan says, applied after every step.

The rules (which masks, when, from which weights, how they combine) are the core's
(:class:`recal_core.model_plan.MaskPlan`); this module only does the tensor work, with one
``torch._foreach_mul_`` on the gradients and one ``masked_fill_`` per pruned parameter per step (a pruned weight is
exactly zero, whatever value it held).
"""

from __future__ import annotations

from typing import Any, Mapping

import torch
from torch import nn

from recal_core import modifiers as M
from recal_core.model_plan import MaskPlan, ModelPlan, is_second_order

from ..sharding import is_sharded, like, whole
from .channels import channel_view, expand, group_masks
from .mfac import GradientWindow, mfac_step
from .obs import FisherBlocks, obs_step
from .magnitude import joint_magnitude_masks, magnitude_mask, nonzero_mask, structured_mask, to_canonical


class MaskState:
    """Per parameter, the mask of each pruning modifier in force and their product (the effective mask)."""

    def __init__(self, plan: ModelPlan, params: Mapping[str, nn.Parameter],
                 kernel_axes: Mapping[str, tuple[int, ...] | None], tensors: Mapping[str, torch.Tensor] | None = None):
        self.plan = plan  # global, OBS and channel-coupled modifiers update several parameters together
        self._tensors = dict(tensors or {})  # the followers' parameters and buffers, by name
        self._followers: list[tuple[torch.Tensor, torch.Tensor]] = []  # (tensor, where pruned), from the groups' masks
        self.plans: dict[str, MaskPlan] = dict(plan.masks)
        self.kernel_axes = {name: kernel_axes[name] for name in self.plans}
        self.params = {name: params[name] for name in self.plans}
        self.masks: dict[str, dict[int, torch.Tensor]] = {name: {} for name in self.plans}
        self.effective: dict[str, torch.Tensor] = {}
        self._pruned: dict[str, torch.Tensor] = {}  # effective == 0, as booleans
        # every pruning modifier once: between its updates a step costs two calls per modifier
        self._sources = list({ps.index: ps for plan in self.plans.values() for ps in plan.sources}.values())
        self._in_force: tuple[bool, ...] | None = None  # per source, at the last update()
        # OBS and M-FAC modifiers: the curvature of their layers (Fisher blocks, gradient windows), filled
        # in the num_grads steps before an update
        self._second_order = [ps for ps in self._sources if is_second_order(ps)]
        self.fishers: dict[int, dict[str, FisherBlocks | GradientWindow]] = {}
        self._next_update: dict[int, int] = {}  # per OBS modifier: its next update step (cached)
        self._last_step = max((ps.span.end or 0 for ps in self._second_order), default=0) + 1
        self._step = 0
        sharded = [name for name, p in self.params.items() if is_sharded(p)]
        if sharded and self._second_order:
            raise ValueError(f"{type(self._second_order[0].modifier).__name__} keeps per-layer curvature of whole "
                             f"gradients, and {sharded[0]} is sharded (FSDP2): second-order pruning does not run "
                             "sharded yet; prune by magnitude, or shard after pruning")

    @torch.no_grad()
    def mask_gradients(self) -> None:
        """Zero the gradients of pruned weights, so the optimizer's state does not move them (and, before
        an OBS update, add them to its Fisher blocks)."""
        grads, masks = [], []
        for name, mask in self.effective.items():
            grad = self.params[name].grad
            if grad is not None:
                grads.append(grad)
                masks.append(mask)
        if grads:
            torch._foreach_mul_(grads, masks)
        for ps in self._second_order:
            if self._update_within(ps, self._step + 1, ps.modifier.num_grads):
                for name, fisher in self._fishers(ps).items():
                    if self.params[name].grad is not None:
                        fisher.add(self.params[name].grad)

    def _update_within(self, ps, first: int, steps: int) -> bool:
        """Whether ``ps`` updates in ``[first, first + steps)``; the next update step is cached, so a run
        scans each step once in all."""
        upcoming = self._next_update.get(ps.index)
        if upcoming is None or upcoming < first:
            upcoming, end = first, self._last_step
            while upcoming <= end and not ps.is_update(upcoming):
                upcoming += 1
            self._next_update[ps.index] = upcoming if upcoming <= end else 2**62  # none left
        return self._next_update[ps.index] < first + steps

    def _fishers(self, ps) -> dict[str, FisherBlocks | GradientWindow]:
        if ps.index not in self.fishers:
            names = [n for n, plan in self.plans.items() if any(s.index == ps.index for s in plan.sources)]
            m = ps.modifier
            self.fishers[ps.index] = {
                n: GradientWindow(self.params[n].numel(), m.fisher_block_size, m.num_grads, self.params[n].device)
                if isinstance(m, M.MFACPruningModifier)
                else FisherBlocks(self.params[n].numel(), m.fisher_block_size, self.params[n].device)
                for n in names}
        return self.fishers[ps.index]

    @torch.no_grad()
    def apply(self) -> None:
        """``w <- 0`` where the mask in force is 0, for every parameter with one: exactly zero whatever the weight
        (a ``w * mask`` would keep a NaN or an infinity there)."""
        for name, pruned in self._pruned.items():
            self.params[name].data.masked_fill_(pruned, 0.0)
        self._apply_followers()

    def _apply_followers(self) -> None:
        for tensor, pruned in self._followers:
            tensor.data.masked_fill_(pruned, 0.0)

    @torch.no_grad()
    def update(self, k: int) -> None:
        """Recompute the masks the plan updates at ``k``, drop those no longer in force, and apply."""
        self._step = k
        signature = tuple(ps.mask_in_force(k) for ps in self._sources)
        if signature == self._in_force and not any(ps.is_update(k) for ps in self._sources):
            return
        self._in_force = signature
        joint = {}  # global modifiers: one ranking across their layers
        for g in self.plan.global_updates(k):
            weights = [whole(self.params[n].data) for n in g.names]
            for name, mask in zip(g.names, joint_magnitude_masks(weights, g.count)):
                joint.setdefault(name, {})[g.modifier] = like(mask, self.params[name])
        for ps, removed in self.plan.second_order_updates(k):
            fishers = self._fishers(ps)
            step = mfac_step if isinstance(ps.modifier, M.MFACPruningModifier) else obs_step
            masks = step({n: self.params[n].data for n in fishers}, fishers, ps.modifier, removed)
            for name, mask in masks.items():
                joint.setdefault(name, {})[ps.index] = mask
            for fisher in fishers.values():
                fisher.reset()
        for group, count in self.plan.channel_updates(k):
            weights = {n: self._canonical(n, whole(self.params[n].data)) for n in group.members}
            for name, mask in group_masks(group, weights, count).items():
                joint.setdefault(name, {})[group.modifier] = like(self._canonical(name, mask, back=True),
                                                                  self.params[name])
        for name, plan in self.plans.items():
            per_modifier = self.masks[name]
            in_force = set(plan.in_force(k))
            changed = False
            for index in [i for i in per_modifier if i not in in_force]:
                del per_modifier[index]
                changed = True
            param = self.params[name].data  # already carries the masks of step k - 1
            if name in joint:
                per_modifier.update(joint[name])
                changed = True
            updates = plan.updates(k)
            weight = whole(param) if updates else param
            for u in updates:
                if u.count is None:
                    mask = nonzero_mask(weight)
                elif u.layout is None:
                    mask = magnitude_mask(weight, u.count)
                else:
                    mask = structured_mask(weight, u.layout, u.count, self.kernel_axes[name])
                per_modifier[u.modifier] = like(mask, param)
                changed = True
            if changed and self._combine(name):
                param.masked_fill_(self._pruned[name], 0.0)
        self._update_followers()
        self._apply_followers()

    def _update_followers(self) -> None:
        """The follower tensors' masks, read off each filter or head group's mask in force (or none)."""
        self._followers = []
        for group in self.plan.channel_groups:
            first = next(iter(group.members))
            mask = self.masks[first].get(group.modifier)
            if group.kind == "channel" or mask is None:
                continue
            keep = channel_view(self._canonical(first, whole(mask)), False, group.members[first]).amax(1)
            for name in group.followers:
                tensor = self._tensors[name]
                pruned = expand(keep, whole(tensor), False, group.follower_widths.get(name, 1)) == 0
                self._followers.append((tensor, like(pruned, tensor)))

    def _canonical(self, name: str, tensor: torch.Tensor, back: bool = False) -> torch.Tensor:
        """``tensor`` (laid out as parameter ``name``) in the canonical order the core's channel groups count in, or
        ``back`` (:func:`~recal_torch.pruning.magnitude.to_canonical`)."""
        axes = self.kernel_axes[name]
        if axes is None or axes == tuple(range(tensor.dim())):
            return tensor
        return to_canonical(tensor, axes, back).contiguous()

    def _combine(self, name: str) -> bool:
        masks = list(self.masks[name].values())
        if not masks:
            self.effective.pop(name, None)
            self._pruned.pop(name, None)
            return False
        effective = masks[0]
        for mask in masks[1:]:
            effective = effective * mask
        self.effective[name] = effective
        self._pruned[name] = effective == 0  # what apply() zeroes (masked_fill: exact zeros, NaN or not)
        return True

    # --- checkpoints ----------------------------------------------------------------------------

    def state_dict(self) -> dict[str, dict[int, torch.Tensor]]:
        return {name: {i: whole(m).clone() for i, m in per.items()} for name, per in self.masks.items() if per}

    def check_state_dict(self, state: Any) -> None:
        """Raise ValueError (and change nothing) unless ``state`` fits these parameters."""
        if not isinstance(state, dict):
            raise ValueError(f"the checkpoint's masks are a {type(state).__name__}, not a dict")
        for name, per in state.items():
            if name not in self.params:
                raise ValueError(f"the checkpoint masks parameter {name!r}, which this recipe does not prune "
                                 f"in this model")
            if not isinstance(per, dict):
                raise ValueError(f"the checkpoint's masks of {name!r} are not a dict")
            shape = tuple(self.params[name].shape)
            for index, mask in per.items():
                if not isinstance(mask, torch.Tensor) or tuple(mask.shape) != shape:
                    got = tuple(mask.shape) if isinstance(mask, torch.Tensor) else type(mask).__name__
                    raise ValueError(f"the checkpoint's mask of {name!r} (modifier {index}) has shape {got}, "
                                     f"the parameter {shape}")
                if not (mask.dtype.is_floating_point or mask.dtype == torch.bool) or mask.is_complex() \
                        or not bool(((mask == 0) | (mask == 1)).all()):
                    raise ValueError(f"the checkpoint's mask of {name!r} (modifier {index}) is not a mask: dtype "
                                     f"{mask.dtype}, values other than 0 and 1 (a corrupt or foreign checkpoint)")

    def load_state_dict(self, state: dict[str, dict[int, torch.Tensor]]) -> None:
        self.check_state_dict(state)
        self.masks = {name: {} for name in self.plans}
        self.effective, self._pruned = {}, {}
        self._in_force = None
        for name, per in state.items():
            param = self.params[name]
            self.masks[name] = {int(i): like(m.to(dtype=param.dtype), param) for i, m in per.items()}
            self._combine(name)
        self._update_followers()

    def release(self) -> None:
        self.masks = {name: {} for name in self.plans}
        self.effective, self._pruned = {}, {}
        self._followers = []
        self._in_force = None

