"""Apply a recipe to a PyTorch training loop: one changed line, ``optimizer = manager.modify(...)``.

``modify`` returns the user's own optimizer with hooks registered on it (step pre/post hooks,
state-dict hooks), so ``copy.deepcopy``, ``pickle``, ``torch.compile`` and checkpointing behave as
they do without recal. After ``k`` calls of ``optimizer.step()``: the masks hold the target
sparsity of step ``k`` (exact count per layer), and the LR, weight decay, trainable flags and QAT
state of step ``k`` are in force for the next forward pass. What those values are is decided by
the core (:mod:`recal_core.model_plan`); the parts here apply them:

- :class:`~recal_torch.pruning.masks.MaskState`: masks, gradient masking;
- :class:`~recal_torch.training.param_groups.ParamGroupSettings`: LR and weight decay per param group;
- :class:`~recal_torch.training.trainable.TrainableFlags`: ``requires_grad``;
- :class:`~recal_torch.qat.control.QATControl`: QAT modules and their switches.
"""

from __future__ import annotations

import warnings
import weakref
from typing import Any, Iterable

import torch
from torch import nn

from recal_core import RecipeError
from recal_core import modifiers as M
from recal_core.errors import RecipeWarning
from recal_core.loggers import RecalLogger
from recal_core.manager import RecipeManager
from recal_core.model_plan import ModelPlan, plan_groups, plan_model
from recal_core.recipe import Recipe

from .tracing import model_graph, remember_example_inputs
from .model_params import describe_parameters, sparsity, unwrap
from .manager_state import STATE_VERSION, check_state
from .modify_checks import curvature_problems, warn_unused_fields
from .optimizer_hooks import LoadStateDictHook, StateDictHook, StepPostHook, StepPreHook, average_gradients
from .pruning import MaskState
from .qat import LogScaleSteps, QATControl, input_groups, layer_schemes, qat_roots, steps_in_log_space
from .training import (LR_FACTOR_KEY, ParamGroupSettings, Teacher, TrainableFlags, distillation_loss, follow_recipe,
                       group_bases, schedule_added_group)


# models and optimizers under a manager now: applying a second recipe on top is an error
_MODIFIED: "weakref.WeakKeyDictionary[Any, ScheduledModifierManager]" = weakref.WeakKeyDictionary()


class ScheduledModifierManager(RecipeManager):
    """Holds a recipe and applies it to one model and optimizer.

    >>> import torch
    >>> manager = ScheduledModifierManager.from_yaml('''
    ... - !EpochRangeModifier {start_epoch: 0, end_epoch: 2}
    ... - !GradualKSModifier {params: __ALL__, init_sparsity: 0.5, final_sparsity: 0.75,
    ...                       start_epoch: 0, end_epoch: 1, update_frequency: 1}''')
    >>> model = torch.nn.Sequential(torch.nn.Linear(8, 8))
    >>> sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    >>> manager.modify(model, sgd, steps_per_epoch=2) is sgd
    True
    >>> float((model[0].weight == 0).float().mean())
    0.5
    """

    def __init__(self, recipe: Recipe):
        super().__init__(recipe)
        self.loggers: list[RecalLogger] = []
        self.plan: ModelPlan | None = None
        self.masks: MaskState | None = None
        self.param_groups: ParamGroupSettings | None = None
        self.trainable: TrainableFlags | None = None
        self.qat: QATControl | None = None
        self.teacher: Teacher | None = None
        self._model: nn.Module | None = None
        self._optimizer: torch.optim.Optimizer | None = None
        self._params: dict[str, nn.Parameter] = {}
        self._hooks: list[Any] = []
        self._bases: list[tuple[float | None, float | None]] = []  # each group's own (lr, weight decay)
        self._step = 0
        self._finalized = False

    @property
    def step(self) -> int:
        """Optimizer steps taken under this manager."""
        return self._step

    @property
    def active(self) -> bool:
        """A model is under this recipe: :meth:`modify` was called and :meth:`finalize` not yet."""
        return self._model is not None and not self._finalized

    @property
    def schedule(self):
        """The recipe bound to ``steps_per_epoch`` (:class:`~recal_core.schedule.RecipeSchedule`)."""
        return None if self.plan is None else self.plan.schedule

    # --- modify ---------------------------------------------------------------------------------

    def modify(self, model: nn.Module, optimizer: torch.optim.Optimizer, steps_per_epoch: int,
               loggers: Iterable[RecalLogger] = (), teacher: nn.Module | None = None,
               quantize_attention: bool = False, example_inputs: Any = None,
               lr_scheduler: Any = None) -> torch.optim.Optimizer:
        """Bind the recipe to ``model`` and ``optimizer``; return ``optimizer`` (hooked, not wrapped).

        Every ``params`` / ``submodules`` entry is resolved now: one that matches nothing is a
        :class:`RecipeError` here, not at some later step. ``teacher``: the model a DistillationModifier
        distils from (see :meth:`loss`). ``quantize_attention``: QAT also quantizes the attention matmuls
        (Q·Kᵀ and P·V) of modules with query / key / value projections (:mod:`recal_torch.qat.attention`).

        Args:
            model: the model to train.
            optimizer: its optimizer; hooked, not wrapped.
            steps_per_epoch: optimizer steps per epoch of the training loop.
            loggers: receivers of the per-step scalars (:class:`~recal_core.loggers.RecalLogger`).
            teacher: the model a DistillationModifier distils from.
            quantize_attention: also quantize attention's matmuls (see the PyTorch page).
            example_inputs: a batch of the model's inputs (a tensor, a tuple, or ``(args, kwargs)``) to trace
                it with ``torch.export`` when a modifier prunes ``filter``, ``channel`` or ``head`` and
                ``torch.fx`` cannot trace it; Hugging Face models need none. Kept on the model: ``thin(model)``
                traces with them too.
            lr_scheduler: a ``LambdaLR`` already on ``optimizer`` that a training framework steps (the Hugging
                Face ``Trainer``'s, Lightning's): while the recipe sets the LR, it is made to follow the recipe,
                so the framework logs and uses the recipe's LR; elsewhere it keeps its own schedule.
        """
        if self._model is not None:
            raise RuntimeError("this manager already modified a model; create a new manager per model")
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, not {type(model).__name__}")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, not {type(optimizer).__name__}")
        for thing, what in ((unwrap(model), "model"), (optimizer, "optimizer")):
            if thing in _MODIFIED:
                raise RuntimeError(f"this {what} is already modified by another recal manager; finalize() that "
                                   "one first, or apply one recipe that holds every modifier")
        remember_example_inputs(unwrap(model), example_inputs)  # thin() and the graphs trace with them later
        schedule = self.recipe.bind(steps_per_epoch)
        infos, params = describe_parameters(model)
        sizes = {name: p.numel() for name, p in params.items()}
        problems = []
        schemes = layer_schemes(self.recipe, unwrap(model))
        try:
            plan = plan_model(schedule, infos, sizes, groups=group_bases(optimizer),
                              channel_spaces=lambda: model_graph(unwrap(model), example_inputs),
                              input_groups=input_groups(schemes))
            problems += curvature_problems(self.recipe, plan)
        except RecipeError as err:
            problems += err.problems
        roots, qat_problems = qat_roots(self.recipe, unwrap(model))
        problems += qat_problems + schemes.problems
        for index, _, _ in schedule.distillation:
            if teacher is None:
                problems.append(self.recipe.problem(index, None, "a DistillationModifier needs a teacher model",
                                                    expected="manager.modify(..., teacher=teacher_model), then "
                                                             "loss = manager.loss(loss, inputs, outputs)"))
        if problems:
            raise RecipeError(problems)
        warn_unused_fields(self.recipe, schedule)
        for note in schemes.notes:
            warnings.warn(note, RecipeWarning, stacklevel=2)
        if any("initial_lr" in g for g in optimizer.param_groups) and schedule.controls_lr and lr_scheduler is None:
            raise RuntimeError("a torch LR scheduler is already attached to this optimizer, and the recipe has "
                               "LR modifiers: they would compound; use either the recipe's LR modifiers or the "
                               "scheduler (a LambdaLR a framework steps: pass it as modify(..., lr_scheduler=...) "
                               "and it follows the recipe)")
        if lr_scheduler is not None and schedule.controls_lr:
            follow_recipe(lr_scheduler, plan.groups, lambda: self._step)
        self.plan = plan
        self._bases = group_bases(optimizer)
        self._model, self._optimizer, self._params = model, optimizer, params
        tensors = {**dict(unwrap(model).named_buffers()), **dict(unwrap(model).named_parameters())}
        self.masks = MaskState(plan, params, {p.name: p.kernel_axes for p in infos}, tensors)
        self.param_groups = ParamGroupSettings(optimizer, plan.groups)
        self.trainable = TrainableFlags(plan, params)
        reduce_range = {i: m.reduce_range for i, m in enumerate(self.recipe.modifiers)
                        if isinstance(m, M.QuantizationModifier)}
        self.qat = QATControl(unwrap(model), roots, schemes.left_float, attention=quantize_attention,
                              reduce_range=reduce_range, weight_only=schemes.weight_only, learned=schemes.learned)
        self.qat.on_learned_scales = self._train_scales
        self._log_steps = LogScaleSteps(steps_in_log_space(optimizer), on_floor=self._say_floored_scales)
        self._lr_scheduler = lr_scheduler
        self.teacher = Teacher(teacher) if teacher is not None else None
        self.loggers = list(loggers)
        self._hooks = [
            optimizer.register_step_pre_hook(StepPreHook(self)),
            optimizer.register_step_post_hook(StepPostHook(self)),
            optimizer.register_state_dict_post_hook(StateDictHook(self)),
            optimizer.register_load_state_dict_pre_hook(LoadStateDictHook(self)),
        ]
        _MODIFIED[unwrap(model)] = self
        _MODIFIED[optimizer] = self
        self._apply_state(0)
        self.masks.update(0)
        return optimizer

    # --- the step -------------------------------------------------------------------------------

    def _gradients_ready(self) -> None:
        """The step's gradients exist: pruned weights' zeroed, learned scales' averaged over the ranks."""
        self.masks.mask_gradients()
        average_gradients(self._log_steps.scales)
        self._log_steps.before_step()

    def _say_floored_scales(self, floored: list[nn.Parameter] | None = None) -> None:
        """Learned scales at float32's eps saturate what they quantize: said, naming them, at the first step that
        floors some (raw steps, SGD's) and at the end for any still there (set so by a checkpoint or by hand too)."""
        floored = self._log_steps.floored() if floored is None else floored
        if floored:
            names = {id(p): n for n, p in unwrap(self._model).named_parameters()}
            warnings.warn(f"step {self._step}: {len(floored)} learned scale(s) at float32's eps (a step took them "
                          f"through zero, or they were set at or below it), which saturates what they quantize: "
                          f"{', '.join(names.get(id(p), '?') for p in floored[:5])}; under "
                          f"{type(self._optimizer).__name__} a scale steps by its gradient: lower observer_kwargs "
                          "lr_factor", RecipeWarning, stacklevel=3)

    def _train_scales(self, scales: list[nn.Parameter], lr_factor: float) -> None:
        """Learned (lsq) quantization scales join the optimizer as a param group of their own: the first group's
        LR times ``lr_factor`` (following it as the recipe moves it), no weight decay. Made again, in the same
        order, when a checkpoint re-creates the QAT layers, so the optimizer's state loads onto them."""
        base = self._optimizer.param_groups[0]
        group = {"params": scales, "lr": float(base["lr"]) * lr_factor, LR_FACTOR_KEY: lr_factor}
        if "weight_decay" in base:
            group["weight_decay"] = 0.0
        self._optimizer.add_param_group(group)
        self._log_steps.add(scales)
        if self._lr_scheduler is not None:
            schedule_added_group(self._lr_scheduler, len(self._optimizer.param_groups) - 1, lr_factor)

    def _after_step(self) -> None:
        self._check_pruned_layers_in_place()
        self.masks.apply()
        self._log_steps.after_step()  # the optimizer's step on each learned scale taken in log space
        self._step += 1
        self._apply_state(self._step)
        self.masks.update(self._step)
        if self.loggers:
            scalars = self.scalars()
            for logger in self.loggers:
                logger.log_scalars(self._step, self.plan.schedule.epoch_of(self._step), scalars)

    def _check_pruned_layers_in_place(self) -> None:
        """A pruned layer replaced (or removed) after ``modify`` would train unpruned while the masks go to its old
        tensor: an error naming it, at the next step (a few attribute lookups per pruned parameter)."""
        for name, param in self.masks.params.items():
            try:
                current = self._model.get_parameter(name)
            except AttributeError:
                current = None
            if current is not param:
                raise RuntimeError(f"the model's {name!r} is no longer the parameter the recipe prunes: its layer was "
                                   f"{'replaced' if current is not None else 'removed'} after modify(); change the "
                                   "model first, then call modify() (the recipe's masks would miss the new layer)")

    def _apply_state(self, k: int) -> None:
        """LR, weight decay, trainable flags and QAT switches in force at step ``k``."""
        self.param_groups.apply(k)
        self.trainable.apply(k)
        self.qat.apply(self.plan.qat(k), k)

    def loss(self, loss: torch.Tensor, inputs: Any, student_outputs: Any) -> torch.Tensor:
        """The loss to back-propagate at this step: ``loss`` blended with knowledge distillation while a
        DistillationModifier is in force (:mod:`recal_torch.training.distillation`), else ``loss`` as is; in the
        training loop: ``loss = manager.loss(criterion(outputs, labels), inputs, outputs)``.

        Args:
            loss: the task loss of this step.
            inputs: the batch the student saw (the teacher sees the same).
            student_outputs: the model's outputs on ``inputs``.
        """
        self._require_modified("loss")
        m = self.plan.schedule.distillation_at(self._step)
        if m is None:
            return loss
        teacher_outputs = self.teacher(inputs)
        return m.hardness * distillation_loss(student_outputs, teacher_outputs, m) + (1 - m.hardness) * loss

    # --- logging --------------------------------------------------------------------------------

    def scalars(self) -> dict[str, float]:
        """What is in force now: measured and target sparsity per layer, LR, weight decay, QAT state."""
        self._require_modified("scalars")
        k = self._step
        out: dict[str, float] = {}
        for ps in self.plan.schedule.pruning:
            target = None if ps.constant else ps.sparsity(k)
            for name in self.plan.prune_targets[ps.index]:
                out[f"sparsity/{name}"] = sparsity(self._params[name])
                if target is not None:
                    out[f"target_sparsity/{name}"] = target
        for i, group in enumerate(self._optimizer.param_groups):
            suffix = "" if i == 0 else f"/group{i}"
            out["lr" + suffix] = float(group["lr"])
            if "weight_decay" in group:
                out["weight_decay" + suffix] = float(group["weight_decay"])
        for index, state in self.plan.qat(k):
            out[f"qat/{index}/enabled"] = float(state.enabled)
            out[f"qat/{index}/bn_frozen"] = float(state.bn_frozen)
            out[f"qat/{index}/observers_frozen"] = float(state.observers_frozen)
        return out

    # --- checkpoints ----------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume exactly: step, masks, trainable flags, QAT state (tensors and
        plain containers only, so ``torch.load(weights_only=True)`` reads it back).

        It is also inside ``optimizer.state_dict()`` under ``"recal"``. Model weights and observer
        statistics are in ``model.state_dict()``; load them *after* :meth:`load_state_dict` (which
        re-creates the QAT modules whose buffers they fill).
        """
        self._require_modified("state_dict")
        return {
            "version": STATE_VERSION,
            "recipe": self.recipe.to_yaml(),
            "steps_per_epoch": self.plan.schedule.steps_per_epoch,
            "step": self._step,
            "group_bases": [list(b) for b in self._bases],
            "original_trainable": dict(self.trainable.original),
            "masks": self.masks.state_dict(),
            "qat_prepared": sorted(self.qat.prepared),
            "finalized": self._finalized,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` into a manager that has already called :meth:`modify`.

        Everything is checked before anything changes: a checkpoint that does not fit leaves the
        manager as it was and raises ``ValueError`` saying what does not match.

        Args:
            state: what :meth:`state_dict` returned, e.g. from a checkpoint.
        """
        self._require_modified("load_state_dict")
        step = check_state(state, self.recipe, self.plan.schedule.steps_per_epoch)
        self.masks.check_state_dict(state["masks"])
        unknown_qat = set(state["qat_prepared"]) - set(self.qat.roots)
        if unknown_qat:
            raise ValueError(f"the checkpoint has QAT state for modifiers {sorted(unknown_qat)}, which this recipe "
                             "lacks")
        bases = [tuple(b) for b in state["group_bases"]]
        # the user's groups (a QAT that starts at step 0 has made recal's groups of learned scales already)
        users = [g for g in self._optimizer.param_groups if LR_FACTOR_KEY not in g]
        if len(bases) != len(users):
            raise ValueError(f"the checkpoint's optimizer had {len(bases)} param groups, this one {len(users)}")
        groups = plan_groups(self.plan.schedule, bases) if bases != self._bases else None
        # checked: now change
        if groups is not None:
            self._bases = bases
            self.param_groups = ParamGroupSettings(self._optimizer, groups)
        self._step = step
        self.trainable.reset(state["original_trainable"])
        self.masks.load_state_dict(state["masks"])
        for index in state["qat_prepared"]:
            if index not in self.qat.prepared:
                self.qat.prepare(index, step)
        self.qat.reset()
        self._apply_state(self._step)
        self.masks.apply()
        self._finalized = bool(state.get("finalized", False))

    @property
    def quantized_layers(self) -> dict[str, str]:
        """The layers QAT quantizes, by module name: what each is and which of its tensors are integers
        (empty before the first QuantizationModifier starts)."""
        return {} if self.qat is None else self.qat.quantized_layers()

    def _require_modified(self, what: str) -> None:
        if self._model is None:
            raise RuntimeError(f"call manager.modify(model, optimizer, steps_per_epoch) before {what}()")

    # --- the end --------------------------------------------------------------------------------

    def finalize(self, model: nn.Module | None = None) -> dict[str, float]:
        """End training under the recipe: masks are baked into the weights and released, recal's hooks
        are removed from the optimizer (later steps are plain steps), and the model may be modified again.

        QAT modules are kept (so :func:`recal_torch.export_onnx` writes a QDQ model) with their
        observers and BatchNorm statistics frozen. Returns the final sparsity per pruned parameter.

        Args:
            model: the model ``modify`` was given (that model when None).
        """
        self._require_modified("finalize")
        if model is not None and unwrap(model) is not unwrap(self._model):
            raise ValueError("finalize() got a different model from the one passed to modify()")
        self._check_pruned_layers_in_place()
        self.masks.apply()
        result = {name: sparsity(self._params[name])
                  for names in self.plan.prune_targets.values() for name in names}
        self.qat.freeze()
        self._log_steps.floor()  # one changed since the last step (loaded, set by hand) too
        self._say_floored_scales()
        self.masks.release()
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        _MODIFIED.pop(unwrap(self._model), None)
        _MODIFIED.pop(self._optimizer, None)
        self._finalized = True
        return result
