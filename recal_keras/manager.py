"""Apply a recipe to a Keras 3 model: ``model, callbacks = manager.modify(model, optimizer, steps_per_epoch)``.

Everything per step happens inside Keras's own train step, so ``jit_compile``, ``steps_per_execution`` and
distribution strategies see it as ordinary graph code, with no host call per step, on each Keras backend
(TensorFlow ops on TensorFlow, ``keras.ops`` on JAX and PyTorch: :mod:`recal_keras.tensor_ops`):

- **masks**: Keras applies a variable's ``constraint`` right after every optimizer update. recal sets one on
  the model's first trainable variable that updates every mask at step ``k = optimizer.iterations + 1`` from
  per-step tables (:class:`recal_keras.mask_ops.PruningMasks`, shared with the graph API), applies them, and
  zeroes the optimizer's per-weight state (momentum, Adam's moments) at pruned positions, so optimizer state
  never moves a pruned weight.
- **learning rate**: the same constraint sets the optimizer's LR variable to the recipe's LR for the next step
  (from a per-step table), so ``optimizer.learning_rate`` stays an ordinary variable that Keras saves, loads
  and logs (a ``LearningRateSchedule`` set on a built optimizer makes TensorFlow unable to save it).
- **weight decay**: the optimizer's ``weight_decay`` becomes the recipe's (:mod:`recal_keras.optimizer_state`).
- **trainable flags**: set at each epoch's start by the callback, with the train function rebuilt.
"""

from __future__ import annotations

import warnings

import keras
import numpy as np
from keras.src.models.functional import Functional  # what keras.Model(inputs, outputs) builds

from recal_core import RecipeError
from recal_core.manager import RecipeManager
from recal_core.model_plan import ModelPlan, plan_model
from recal_core.recipe import Recipe
from recal_core.schedule import RecipeSchedule

from .mask_ops import PruningMasks, per_step, zeroed
from .errors import RecalWarning
from .recipe_support import check_table_size, learned_scales, qat_problems, torch_only_problems
from .tensor_ops import KerasOps, TensorFlowOps
from .backends import backend_problems, check_strategy, current_backend
from .callback import RecalCallback
from .learned_scales import no_decay_on_scales
from .mask_constraint import ApplyMasks
from .optimizer_state import add_recal_variable, float_lr, install_weight_decay, slots_of
from .params import describe_model
from .qat_tables import QATTables


class ScheduledModifierManager(RecipeManager):
    """Holds a recipe and applies it to a Keras 3 model trained with ``model.fit``.

    >>> manager = ScheduledModifierManager.from_yaml("recipe.yaml")         # doctest: +SKIP
    >>> model, callbacks = manager.modify(model, optimizer, steps_per_epoch=100)  # doctest: +SKIP
    >>> model.compile(optimizer=optimizer, loss=...)                        # doctest: +SKIP
    >>> model.fit(x, y, epochs=manager.max_epochs, callbacks=callbacks)     # doctest: +SKIP
    >>> manager.finalize(model)                                              # doctest: +SKIP
    """

    def __init__(self, recipe: Recipe):
        super().__init__(recipe)
        self.schedule: RecipeSchedule | None = None
        self.plan: ModelPlan | None = None
        self._model: keras.Model | None = None
        self._optimizer = None
        self._masks: PruningMasks | None = None
        self._slots: dict[str, list] = {}
        self._tf = True  # TensorFlow ops (else keras.ops on JAX or PyTorch)
        self._ops: TensorFlowOps | KerasOps | None = None
        self._weight_decay = None  # JAX / PyTorch: the optimizer variable holding the decay in force
        self._wd_values: np.ndarray | None = None
        self._driver: keras.Variable | None = None
        self._driver_inner = None
        self._by_name: dict[str, keras.Variable] = {}
        self._original_trainable: dict[str, bool] = {}
        self._lr_values: np.ndarray | None = None
        self._qat: QATTables | None = None
        self.quantized_layers: list[str] = []  # the Conv2D / Dense layers QAT quantizes
        self._finalized = False

    # --- modify -------------------------------------------------------------------------------

    def modify(self, model: keras.Model, optimizer: keras.optimizers.Optimizer,
               steps_per_epoch: int) -> tuple[keras.Model, list[keras.callbacks.Callback]]:
        """Apply the recipe to ``model`` trained by ``optimizer``; returns ``(model, callbacks)``.

        Call it once, after the model is built and before ``compile`` (inside a ``tf.distribute`` strategy's
        scope when there is one), on Keras's TensorFlow, JAX or PyTorch backend (:mod:`recal_keras.backends`
        says what each runs), then ``model.compile(optimizer=optimizer, ...)`` and
        ``model.fit(..., callbacks=callbacks)``. Pruning, LR and the rest change the model in place; a
        QuantizationModifier returns a new model (Sequential or functional) whose QAT layers reuse the
        original layers and variables: compile and fit the returned model.

        Args:
            model: a built ``keras.Model``.
            optimizer: the optimizer it will be compiled with (the inner one of a ``LossScaleOptimizer``).
            steps_per_epoch: optimizer steps per epoch of ``fit``.
        """
        if self._model is not None:
            raise RuntimeError("modify() was already called on this manager; use one manager per model")
        backend = current_backend()
        if not isinstance(model, keras.Model):
            raise TypeError(f"modify() takes a keras.Model, not {type(model).__name__}")
        if not isinstance(optimizer, keras.optimizers.Optimizer):
            raise TypeError(f"modify() takes a keras.optimizers.Optimizer, not {type(optimizer).__name__}")
        if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
            raise TypeError("modify() takes the inner optimizer of a LossScaleOptimizer: pass "
                            "optimizer.inner_optimizer, then compile with the LossScaleOptimizer")
        if getattr(optimizer, "gradient_accumulation_steps", None):
            raise ValueError(f"the optimizer accumulates gradients over {optimizer.gradient_accumulation_steps} "
                             "batches: the recipe's steps are optimizer updates, and Keras counts every batch in "
                             "optimizer.iterations; use a larger batch instead of gradient_accumulation_steps")
        if not model.built or not model.weights:
            raise ValueError(f"model {model.name!r} has no weights yet: build it first (give it a keras.Input, "
                             "call model.build(input_shape), or call it on a batch) before modify()")
        if int(steps_per_epoch) < 1:
            raise ValueError(f"steps_per_epoch must be a positive integer, got {steps_per_epoch!r}")
        self._tf = backend == "tensorflow"
        self._ops = TensorFlowOps() if self._tf else KerasOps()
        if self._tf:
            check_strategy(model)
        schedule = self.recipe.bind(int(steps_per_epoch))
        check_table_size(schedule, "recal_keras")
        if backend_problems(schedule, backend):
            raise RecipeError(backend_problems(schedule, backend))
        if schedule.quantization:
            model = self._quantize(model, schedule, optimizer)
        infos, by_name = describe_model(model)
        base_lr = float_lr(optimizer)
        wd = optimizer.weight_decay
        self.plan = self._plan(schedule, infos, by_name, base_lr, None if wd is None else float(wd))
        self.schedule, self._model, self._optimizer, self._by_name = schedule, model, optimizer, by_name
        self._original_trainable = {name: bool(v.trainable) for name, v in by_name.items()}
        if not optimizer.built:  # its state exists before the first step: masked, and restorable from a checkpoint
            optimizer.build([v for v in model.weights if v.trainable] +
                            [v for n, v in by_name.items() if n in self._ever_trainable() and not v.trainable])
        self._install_lr(optimizer, base_lr)
        self._install_weight_decay(optimizer)
        if self.plan.masks:
            self._install_masks(infos, optimizer)
        if self.plan.masks or self._lr_values is not None or self._wd_values is not None:
            self._attach_driver(model)
        self._apply_now()
        return model, [RecalCallback(self)]

    def _quantize(self, model: keras.Model, schedule: RecipeSchedule, optimizer) -> keras.Model:
        """The model with its Conv2D(-BN)(-ReLU) and Dense(-ReLU) as QAT layers (:mod:`recal_keras.qat`),
        switched on, BN-frozen and observer-frozen at the steps the recipe says."""
        index, _ = schedule.quantization[0]
        from .quantized_layer import QuantizedLayer
        from .qat_model import quantize_model

        if not isinstance(model, (keras.Sequential, Functional)):
            raise RecipeError(self.recipe.problem(
                index, None, f"QAT rewrites the model with keras.models.clone_model, which cannot rebuild the "
                f"subclassed model {model.name!r} ({type(model).__name__})",
                expected="a Sequential or functional model (keras.Model(inputs, outputs)) for QAT"))
        self._qat = QATTables.from_schedule(schedule, index, optimizer.iterations, ops=self._ops)
        learn = learned_scales(schedule.recipe.modifiers[index])
        quantized, made, floating = quantize_model(model, self._qat, learn)
        if not made:
            raise RecipeError(self.recipe.problem(
                index, None, f"model {model.name!r} has no Conv2D, DepthwiseConv2D or Dense layer to quantize",
                expected="a model with Conv2D, DepthwiseConv2D or Dense layers"))
        if floating:
            warnings.warn(f"{self.recipe.describe(index)}: these layers with weights stay float (recal's Keras QAT "
                          f"quantizes Conv2D, DepthwiseConv2D and Dense): {', '.join(floating)}", RecalWarning,
                          stacklevel=4)
        if keras.backend.backend() == "jax":  # a JAX forward pass reads the model's variables only
            next(q for q in made if isinstance(q, QuantizedLayer)).count_steps(self._qat, optimizer.iterations)
        self.quantized_layers = [q.layer.name for q in made]
        self._observers = [o for q in made for o in q.quantizers]
        if any(learn):
            no_decay_on_scales(optimizer, quantized)
        return quantized

    def _plan(self, schedule: RecipeSchedule, infos, by_name, base_lr, base_wd) -> ModelPlan:
        """The core's plan for this model; plus what Keras cannot do yet, every problem at once."""
        problems = qat_problems(schedule, "for Keras", learns=True)
        problems += torch_only_problems(schedule, "for Keras")
        try:
            plan = plan_model(schedule, infos, {n: int(np.prod(v.shape)) for n, v in by_name.items()},
                              groups=[(base_lr, base_wd)])
        except RecipeError as err:
            problems += err.problems
        if problems:
            raise RecipeError(problems)
        for ps in schedule.pruning:
            kind = getattr(ps.modifier, "mask_type", "unstructured")
            if kind in ("filter", "channel"):
                warnings.warn(f"{self.recipe.describe(ps.index)}: mask_type {kind!r} ranks each Keras layer's "
                              "channels alone (the layers that share channels are not coupled in Keras yet), so "
                              "the pruned model cannot be thinned", RecalWarning, stacklevel=4)
        return plan

    def _install_lr(self, optimizer, base_lr: float | None) -> None:
        if not self.schedule.controls_lr:
            return
        if base_lr is None and not isinstance(optimizer._learning_rate, keras.Variable):
            raise ValueError("the recipe sets the learning rate, but the optimizer's learning_rate is a schedule: "
                             "create the optimizer with a float learning_rate (the recipe's LR replaces it)")
        lr = self.plan.groups[0].lr
        values = per_step(lr, self.schedule.total_steps)
        values[np.isnan(values)] = np.nan if base_lr is None else base_lr
        self._lr_values = values.astype(np.float32)

    def _install_weight_decay(self, optimizer) -> None:
        wd = self.plan.groups[0].weight_decay
        values = per_step(wd, self.schedule.total_steps)
        if np.isnan(values).all():
            return
        values[np.isnan(values)] = float(optimizer.weight_decay or 0.0)
        self._weight_decay = install_weight_decay(optimizer, values, as_table=self._tf)
        self._wd_values = None if self._weight_decay is None else values.astype(np.float32)

    def _install_masks(self, infos, optimizer) -> None:
        variables = {name: self._native(v) for name, v in self._by_name.items()}

        def make_variable(name, shape, dtype, initial):
            if self._tf:
                import tensorflow as tf

                return tf.Variable(tf.fill(shape, tf.constant(initial, dtype)), trainable=False,
                                   name=name.replace("/", "_"), dtype=dtype)
            return add_recal_variable(optimizer, shape, initial, dtype, name.replace("/", "_"))

        kernel_axes = {p.name: p.kernel_axes for p in infos}
        self._masks = PruningMasks(self.plan, variables, kernel_axes, make_variable, variables.__getitem__,
                                   ops=self._ops)
        self._slots = {name: [self._native(s) for s in slots_of(optimizer, self._by_name[name])]
                       for name in self.plan.masks}

    def _native(self, variable):
        """What the step's ops write: TensorFlow's own variable under a Keras one; the Keras variable elsewhere."""
        return variable.value if self._tf else variable

    def _ever_trainable(self) -> set[str]:
        names = set()
        for index, m, _ in self.schedule.trainable:
            if m.trainable:
                names.update(self.plan.trainable_targets[index])
        return names

    def _attach_driver(self, model: keras.Model) -> None:
        """The mask step rides on the first trainable variable's constraint (every update runs it)."""
        self._detach_driver()
        driver = next((v for v in model.trainable_weights), None)
        if driver is None:
            return
        self._driver, self._driver_inner = driver, driver.constraint
        driver.constraint = ApplyMasks(self, driver.constraint)

    def _detach_driver(self) -> None:
        if self._driver is not None:
            self._driver.constraint = self._driver_inner
            self._driver = self._driver_inner = None

    def _step(self, k):
        """recal's step at ``k``, run by the driver's constraint; returns the driver's value after it."""
        ops = self._step_ops(k)
        o, driver = self._ops, self._native(self._driver)
        if not self._tf:
            return o.read(driver)
        import tensorflow as tf

        with tf.control_dependencies(ops):
            return tf.identity(o.read(driver))

    def _step_ops(self, k) -> list:
        """recal's step at ``k`` (graph code): masks updated and applied, optimizer state masked, the LR and weight
        decay of the step after ``k`` set."""
        o = self._ops
        k = o.minimum(o.cast(k, o.index_dtype), self.schedule.total_steps)
        ops = []
        tables = [(self._optimizer._learning_rate, self._lr_values), (self._weight_decay, self._wd_values)]
        for variable, values in tables:
            if values is not None:
                variable = self._native(variable)
                ops.append(o.assign(variable, o.cast(o.take(o.constant(values), k), o.dtype_of(variable))))
        if self._masks is not None:
            mask_ops, factors = self._masks.ops_and_factors(k)
            ops += mask_ops
            for name, slots in self._slots.items():
                for slot in slots:
                    ops.append(o.assign(slot, zeroed(o.read(slot), [factors[name]], o)))
        return [op for op in ops if op is not None]

    # --- during fit -----------------------------------------------------------------------------

    def _current_step(self) -> int:
        return int(self._optimizer.iterations.numpy())

    def _apply_now(self) -> None:
        """The masks and LR in force at the current step, applied before the next forward pass: at ``modify`` (so a
        custom ``GradientTape`` loop's first step runs at the recipe's LR too) and at each epoch's start (after every
        ``on_train_begin``: ``BackupAndRestore`` or a checkpoint may have restored the weights and
        ``optimizer.iterations``), and at ``finalize``.

        Run eagerly: a few calls a fit, and tracing the step's graph for every layer cost more than running it (3.9
        s against 0.2 s for MobileNetV2's 53 layers); the eager ops run in the order a traced function would."""
        if self._qat is not None and self._qat.counter is not None:  # JAX: the step QAT's switches read
            self._qat.counter.assign(self._current_step())
        if self._masks is None and self._lr_values is None and self._wd_values is None:
            return
        if not self._tf:
            self._restart(self._current_step())
            return
        import tensorflow as tf

        with tf.init_scope():
            self._restart(self._current_step())

    def _restart(self, step: int) -> None:
        o = self._ops
        k = o.constant(min(step, self.schedule.total_steps), o.index_dtype)
        if self._masks is not None:
            self._masks.restart_ops(k)
        self._step_ops(k)

    def _apply_trainable(self, model: keras.Model) -> bool:
        """Trainable flags in force now; True when they changed (the train function must be rebuilt)."""
        if not self.plan.trainable_names:
            return False
        flags = self.plan.trainable(self._current_step(), self._original_trainable)
        changed = False
        for name, flag in flags.items():
            variable = self._by_name[name]
            if bool(variable.trainable) != flag:
                variable.trainable = flag
                changed = True
        if changed and self._driver is not None:
            self._attach_driver(model)
        return changed

    def scalars(self) -> dict[str, float]:
        """What TensorBoard shows under recal's names: the LR and each pruned weight's sparsity now."""
        self._require_modified("scalars")
        out = {}
        lr = self._optimizer.learning_rate
        out["Modifier_LR/learning_rate"] = float(lr.numpy() if hasattr(lr, "numpy") else lr)
        for name in self.plan.masks:
            value = self._by_name[name].numpy()
            out[f"Modifier_Pruning/{name}"] = float((value == 0).mean())
        return out

    def _require_modified(self, what: str) -> None:
        if self._model is None:
            raise RuntimeError(f"call manager.modify(model, optimizer, steps_per_epoch) before {what}()")

    # --- finalize -------------------------------------------------------------------------------

    def finalize(self, model: keras.Model | None = None) -> dict[str, float]:
        """Bake the masks in force into the weights and take recal out of the model and optimizer: the
        constraint goes, the trainable flags are restored; the LR schedule stays on the optimizer.
        Returns each pruned weight's sparsity.

        Args:
            model: the model ``modify`` returned (that model when None)."""
        self._require_modified("finalize")
        if model is not None and model is not self._model:
            raise ValueError("finalize() got a different model from the one modify() changed")
        if self._finalized:
            raise RuntimeError("finalize() was already called for this model")
        self._check_pruned_in_model()
        self._apply_now()
        self._detach_driver()
        if self._qat is not None:
            self._finalize_qat()
        for name, flag in self._original_trainable.items():
            if bool(self._by_name[name].trainable) != flag:
                self._by_name[name].trainable = flag
        self._finalized = True
        return {name: float((self._by_name[name].numpy() == 0).mean()) for name in self.plan.masks}

    def _check_pruned_in_model(self) -> None:
        """Refuse to go on when a pruned weight is no longer the model's: its layer was replaced or removed after
        modify(), so the masks would go to the old weight while the new one trains unpruned."""
        held = {id(v) for v in self._model.weights}
        gone = [name for name in self.plan.masks if id(self._by_name[name]) not in held]
        if gone:
            raise ValueError(f"pruned weights are no longer part of model {self._model.name!r}: "
                             f"{', '.join(gone[:5])}{' ...' if len(gone) > 5 else ''} (their layers were replaced or "
                             "removed after modify()); change the model first, then call modify() on it")

    def _finalize_qat(self) -> None:
        """From now on the QAT layers trace as plain fake-quantized inference; or, when QAT never ran (no range
        observed), as the float model they compute with QAT off."""
        from .qat_tables import quantize_at_completion

        unobserved = [o.name for o in self._observers if float(o.observed.numpy()) == 0]
        if quantize_at_completion(self.recipe, self.schedule.quantization[0][0], unobserved, len(self._observers),
                                  self._current_step(), RecalWarning, stacklevel=3):
            self._qat.export = True
        else:
            self.quantized_layers = []
            self._qat.enabled = np.zeros_like(self._qat.enabled)  # off whatever the step
        for make in (self._model.make_predict_function, self._model.make_test_function):
            make(force=True)  # traced again with the switches as they are now
