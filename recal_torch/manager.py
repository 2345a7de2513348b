"""Apply a recipe to a PyTorch training loop: one changed line, ``optimizer = manager.modify(...)``.

Every value comes from the core's bound schedule (:class:`recal_core.schedule.RecipeSchedule`);
this module only turns them into tensor operations. After ``k`` calls of ``optimizer.step()``:
masks hold the target sparsity of step ``k`` (exact count per layer), and the LR, weight
decay, trainable flags and QAT state of step ``k`` are in force for the next forward pass.
"""

from __future__ import annotations

import logging
from typing import Any, Iterable, Sequence

import torch
from torch import nn

from recal_core import RecipeError, load_recipe
from recal_core.manager import RecipeManager
from recal_core import modifiers as M
from recal_core.loggers import RecalLogger
from recal_core.params import ParamInfo, resolve_params, strip_wrapper
from recal_core.recipe import Recipe
from recal_core.schedule import RecipeSchedule

from .model_params import describe_parameters, sparsity, unwrap
from .optimizer import RecalOptimizer
from .pruning import magnitude_mask, nonzero_mask
from .qat import fake_quantizers, prepare_qat, qat_modules, quantizable_layers

log = logging.getLogger(__name__)

STATE_VERSION = 1


class ScheduledModifierManager(RecipeManager):
    """Holds a recipe and applies it to one model and optimizer.

    >>> import torch
    >>> manager = ScheduledModifierManager.from_yaml('''
    ... - !EpochRangeModifier {start_epoch: 0, end_epoch: 2}
    ... - !GradualKSModifier {params: __ALL__, init_sparsity: 0.5, final_sparsity: 0.75,
    ...                       start_epoch: 0, end_epoch: 1, update_frequency: 1}''')
    >>> model = torch.nn.Sequential(torch.nn.Linear(8, 8))
    >>> optimizer = manager.modify(model, torch.optim.SGD(model.parameters(), lr=0.1), steps_per_epoch=2)
    >>> float((model[0].weight == 0).float().mean())
    0.5
    """

    def __init__(self, recipe: Recipe):
        super().__init__(recipe)
        self.schedule: RecipeSchedule | None = None
        self.loggers: list[RecalLogger] = []
        self._model: nn.Module | None = None
        self._optimizer: torch.optim.Optimizer | None = None
        self._finalized = False
        self._step = 0

    @property
    def step(self) -> int:
        """Optimizer steps taken under this manager."""
        return self._step

    # --- modify ---------------------------------------------------------------------------------

    def modify(self, model: nn.Module, optimizer: torch.optim.Optimizer, steps_per_epoch: int,
               loggers: Iterable[RecalLogger] = ()) -> RecalOptimizer:
        """Bind the recipe to ``model`` and ``optimizer``; return the optimizer to train with.

        Every ``params`` / ``submodules`` entry is resolved now: one that matches nothing is a
        :class:`RecipeError` here, not at some later step.
        """
        if self._model is not None:
            raise RuntimeError("this manager already modified a model; create a new manager per model")
        if isinstance(optimizer, RecalOptimizer):
            raise RuntimeError("this optimizer is already wrapped by a recal manager; pass the original")
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, not {type(model).__name__}")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, not {type(optimizer).__name__}")
        schedule = self.recipe.bind(steps_per_epoch)
        infos, by_name = describe_parameters(model)
        problems = []
        self._prune_targets: dict[int, list[str]] = {}
        for ps in schedule.pruning:
            problems += self._resolve(ps.index, infos, pruning=True, into=self._prune_targets)
        self._trainable_targets: dict[int, list[str]] = {}
        for index, _, _ in schedule.trainable:
            problems += self._resolve(index, infos, pruning=False, into=self._trainable_targets)
        self._qat_roots: dict[int, list[str]] = {}
        for index, m in schedule.quantization:
            problems += self._check_qat(index, m, unwrap(model))
        if problems:
            raise RecipeError(problems)

        self.schedule = schedule
        self._model = model
        self._params = by_name
        self._optimizer = optimizer
        self.loggers = list(loggers)
        self._base_lrs = [group["lr"] for group in optimizer.param_groups]
        if schedule.needs_base_lr() and any(lr is None for lr in self._base_lrs):
            raise ValueError("a LearningRateModifier without init_lr needs the optimizer's lr")
        trainable_names = {n for names in self._trainable_targets.values() for n in names}
        self._original_trainable = {n: by_name[n].requires_grad for n in trainable_names}
        self._masks: dict[str, dict[int, torch.Tensor]] = {}
        self._effective: dict[str, torch.Tensor] = {}
        self._qat_prepared: set[int] = set()
        self._qat_applied: dict[int, tuple[bool, bool]] = {}
        self._trainable_rules: tuple[int, ...] | None = None
        self._step = 0
        wrapped = RecalOptimizer(optimizer, self)
        self._apply_state(0)
        self._update_masks(0)
        return wrapped

    def _resolve(self, index: int, infos: Sequence[ParamInfo], pruning: bool, into: dict[int, list[str]]) -> list:
        try:
            into[index] = [p.name for p in resolve_params(self.recipe, index, infos, pruning=pruning)]
            return []
        except RecipeError as err:
            return err.problems

    def _check_qat(self, index: int, m: M.QuantizationModifier, root: nn.Module) -> list:
        names = [strip_wrapper(n) for n in (m.submodules or [""])]
        problems = []
        available = {n for n, _ in root.named_modules()}
        for name in names:
            if name not in available:
                import difflib

                close = difflib.get_close_matches(name, sorted(available), n=5, cutoff=0.4)
                problems.append(self.recipe.problem(index, "submodules", f"no submodule named {name!r}",
                                                    expected="one of " + (", ".join(close) or "the model's modules")))
            elif not quantizable_layers(root.get_submodule(name)):
                problems.append(self.recipe.problem(
                    index, "submodules" if name else None,
                    f"{'submodule ' + repr(name) if name else 'the model'} has no quantizable layer",
                    expected="Conv1d/2d/3d (zero padding) or Linear layers to quantize"))
        self._qat_roots[index] = names
        return problems

    # --- the step -------------------------------------------------------------------------------

    def _before_optimizer_step(self) -> None:
        if self._finalized or not self._effective:
            return
        grads, masks = [], []
        for name, mask in self._effective.items():
            grad = self._params[name].grad
            if grad is not None:
                grads.append(grad)
                masks.append(mask)
        if grads:
            torch._foreach_mul_(grads, masks)

    def _after_optimizer_step(self) -> None:
        if self._finalized:
            return
        self._apply_masks()
        self._step += 1
        self._apply_state(self._step)
        self._update_masks(self._step)
        if self.loggers:
            self._log(self._step)

    @torch.no_grad()
    def _apply_masks(self) -> None:
        if self._effective:
            names = list(self._effective)
            torch._foreach_mul_([self._params[n].data for n in names], [self._effective[n] for n in names])

    def _apply_state(self, k: int) -> None:
        """LR, weight decay, trainable flags and QAT switches in force at step ``k``."""
        schedule = self.schedule
        for group, base in zip(self._optimizer.param_groups, self._base_lrs):
            lr = schedule.lr(k, base_lr=base)
            if lr is not None:
                group["lr"] = lr
        wd = schedule.weight_decay(k)
        if wd is not None:
            for group in self._optimizer.param_groups:
                group["weight_decay"] = wd
        self._apply_trainable(k)
        self._apply_qat(k)

    def _apply_trainable(self, k: int) -> None:
        rules = self.schedule.trainable_rules(k)
        key = tuple(i for i, _ in rules)
        if key == self._trainable_rules:
            return
        self._trainable_rules = key
        desired = dict(self._original_trainable)
        for index, m in rules:
            for name in self._trainable_targets[index]:
                desired[name] = m.trainable
        for name, flag in desired.items():
            self._params[name].requires_grad_(flag)

    def _apply_qat(self, k: int) -> None:
        for index, _ in self.schedule.quantization:
            state = self.schedule.qat(index, k)
            if not state.enabled:
                continue
            if index not in self._qat_prepared:
                self._prepare_qat(index)
            flags = (state.bn_frozen, state.observers_frozen)
            if self._qat_applied.get(index) != flags:
                for root in self._qat_roots_modules(index):
                    for module in qat_modules(root):
                        module.bn_frozen = state.bn_frozen
                    for fq in fake_quantizers(root):
                        fq.observer_enabled = not state.observers_frozen
                self._qat_applied[index] = flags

    def _prepare_qat(self, index: int) -> None:
        root = unwrap(self._model)
        for name in self._qat_roots[index]:
            created = prepare_qat(root.get_submodule(name))
            log.info("QAT on %s: %d layers quantized (step %d)", name or type(root).__name__, len(created), self._step)
        self._qat_prepared.add(index)

    def _qat_roots_modules(self, index: int) -> list[nn.Module]:
        root = unwrap(self._model)
        return [root.get_submodule(name) for name in self._qat_roots[index]]

    @torch.no_grad()
    def _update_masks(self, k: int) -> None:
        changed: set[str] = set()
        for ps in self.schedule.pruning:
            names = self._prune_targets[ps.index]
            in_force = ps.mask_in_force(k)
            for name in names:
                per_modifier = self._masks.setdefault(name, {})
                if not in_force:
                    if per_modifier.pop(ps.index, None) is not None:
                        changed.add(name)
                    continue
                if ps.is_update(k) or ps.index not in per_modifier:
                    weight = self._params[name].data
                    per_modifier[ps.index] = nonzero_mask(weight) if ps.constant else magnitude_mask(
                        weight, ps.sparsity(k))
                    changed.add(name)
        for name in changed:
            if self._combine(name):
                self._params[name].data.mul_(self._effective[name])

    def _combine(self, name: str) -> bool:
        """Set the effective mask of ``name`` (the product of the masks in force); False if none is."""
        masks = list(self._masks.get(name, {}).values())
        if not masks:
            self._effective.pop(name, None)
            return False
        effective = masks[0]
        for mask in masks[1:]:
            effective = effective * mask
        self._effective[name] = effective
        return True

    # --- logging --------------------------------------------------------------------------------

    def scalars(self) -> dict[str, float]:
        """What is in force now: measured and target sparsity per layer, LR, weight decay, QAT state."""
        k = self._step
        out: dict[str, float] = {}
        for ps in self.schedule.pruning:
            target = None if ps.constant else ps.sparsity(k)
            for name in self._prune_targets[ps.index]:
                out[f"sparsity/{name}"] = sparsity(self._params[name])
                if target is not None:
                    out[f"target_sparsity/{name}"] = target
        for i, group in enumerate(self._optimizer.param_groups):
            suffix = "" if i == 0 else f"/group{i}"
            out["lr" + suffix] = float(group["lr"])
            if "weight_decay" in group:
                out["weight_decay" + suffix] = float(group["weight_decay"])
        for index, _ in self.schedule.quantization:
            state = self.schedule.qat(index, k)
            out[f"qat/{index}/enabled"] = float(state.enabled)
            out[f"qat/{index}/bn_frozen"] = float(state.bn_frozen)
            out[f"qat/{index}/observers_frozen"] = float(state.observers_frozen)
        return out

    def _log(self, k: int) -> None:
        scalars = self.scalars()
        for logger in self.loggers:
            logger.log_scalars(k, self.schedule.epoch_of(k), scalars)

    # --- checkpoints ----------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume exactly: step, masks, base LRs, trainable flags, QAT state.

        Model weights and observer statistics are in ``model.state_dict()``; load them *after*
        :meth:`load_state_dict` (which re-creates the QAT modules whose buffers they fill).
        """
        self._require_modified("state_dict")
        return {
            "version": STATE_VERSION,
            "recipe": self.recipe.to_yaml(),
            "steps_per_epoch": self.schedule.steps_per_epoch,
            "step": self._step,
            "base_lrs": list(self._base_lrs),
            "original_trainable": dict(self._original_trainable),
            "masks": {name: {i: m.clone() for i, m in per.items()} for name, per in self._masks.items()},
            "qat_prepared": sorted(self._qat_prepared),
            "finalized": self._finalized,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` into a manager that has already called :meth:`modify`."""
        self._require_modified("load_state_dict")
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"unsupported recal state version {state.get('version')!r}")
        if load_recipe(state["recipe"]) != self.recipe:
            raise ValueError("the checkpoint was taken under a different recipe than this manager's")
        if state["steps_per_epoch"] != self.schedule.steps_per_epoch:
            raise ValueError(f"the checkpoint used steps_per_epoch={state['steps_per_epoch']}, "
                             f"this run {self.schedule.steps_per_epoch}")
        self._step = int(state["step"])
        self._base_lrs = list(state["base_lrs"])
        self._original_trainable = dict(state["original_trainable"])
        self._masks = {}
        for name, per in state["masks"].items():
            if name not in self._params:
                raise ValueError(f"the checkpoint masks parameter {name!r}, which this model does not have")
            device = self._params[name].device
            self._masks[name] = {int(i): m.to(device) for i, m in per.items()}
        self._effective = {}
        for name in self._masks:
            self._combine(name)
        self._trainable_rules = None
        self._qat_applied = {}
        for index in state["qat_prepared"]:
            if index not in self._qat_prepared:
                self._prepare_qat(index)
        self._apply_state(self._step)
        self._apply_masks()
        self._finalized = bool(state.get("finalized", False))

    def _require_modified(self, what: str) -> None:
        if self._model is None:
            raise RuntimeError(f"call manager.modify(model, optimizer, steps_per_epoch) before {what}()")

    # --- the end --------------------------------------------------------------------------------

    def finalize(self, model: nn.Module | None = None) -> dict[str, float]:
        """End training under the recipe: masks are baked into the weights and released.

        QAT modules are kept (so :func:`recal_torch.export_onnx` writes a QDQ model) with their
        observers and BatchNorm statistics frozen. Returns the final sparsity per pruned parameter.
        Later ``optimizer.step()`` calls step the wrapped optimizer only.
        """
        self._require_modified("finalize")
        if model is not None and unwrap(model) is not unwrap(self._model):
            raise ValueError("finalize() got a different model from the one passed to modify()")
        self._apply_masks()
        result = {}
        for names in self._prune_targets.values():
            for name in names:
                result[name] = sparsity(self._params[name])
        for module in qat_modules(unwrap(self._model)):
            module.bn_frozen = True
        for fq in fake_quantizers(unwrap(self._model)):
            fq.observer_enabled = False
        self._masks, self._effective = {}, {}
        self._finalized = True
        return result
