"""The models, data and helpers the Keras tests share."""

import numpy as np
import pytest
tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")
from recal_core import load_recipe  # noqa: E402
from recal_core.model_plan import plan_model  # noqa: E402
from recal_keras import ScheduledModifierManager  # noqa: E402
from recal_keras.params import describe_model  # noqa: E402
from tests.support.keras_blocks import QAT, SPE, block_to_int8  # noqa: E402


PRUNE = """
- !GradualKSModifier {params: __ALL_PRUNABLE__, init_sparsity: 0.05, final_sparsity: 0.8, start_epoch: 0.0,
                      end_epoch: 3.0, update_frequency: 0.6}
- !LearningRateModifier {lr_class: ExponentialLR, lr_kwargs: {gamma: 0.8}, init_lr: 0.01, start_epoch: 0.0,
                         end_epoch: 4.0}
"""


def _net(name="net"):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((8, 8, 1))
    x = keras.layers.Conv2D(8, 3, name="c1")(inputs)
    x = keras.layers.BatchNormalization(name="bn")(x)
    x = keras.layers.ReLU()(x)
    x = keras.layers.Conv2D(8, 3, name="c2")(x)
    x = keras.layers.Flatten()(x)
    return keras.Model(inputs, keras.layers.Dense(10, name="fc")(x), name=name)


def _data(n=SPE * 32, seed=0):
    rng = np.random.default_rng(seed)
    return rng.random((n, 8, 8, 1), dtype=np.float32), rng.integers(0, 10, n)


def _expected(recipe_text, model, k):
    """The core's zero count per kernel after ``k`` steps and the LR of step ``k``."""
    recipe = load_recipe(recipe_text)
    schedule = recipe.bind(SPE)
    infos, by_name = describe_model(model)
    plan = plan_model(schedule, infos, {n: int(np.prod(v.shape)) for n, v in by_name.items()})
    zeros = {}
    for name, mp in plan.masks.items():
        for ps in mp.sources:
            ids, in_force, steps = ps.tables(schedule.total_steps)
            kk = min(k, schedule.total_steps)
            zeros[name] = mp.zeros(ps, steps[ids[kk]]) if in_force[kk] else 0
    return zeros, plan.groups[0].lr(k)


class _Record(keras.callbacks.Callback):
    def __init__(self, model, optimizer, names):
        super().__init__()
        self.rows, self.m, self.opt, self.names = [], model, optimizer, names

    def on_train_batch_end(self, batch, logs=None):
        _, by_name = describe_model(self.m)
        k = int(self.opt.iterations.numpy())
        zeros = {n: int((by_name[n].numpy() == 0).sum()) for n in self.names}
        slots = {n: int(sum(((s.numpy() != 0) & (by_name[n].numpy() == 0)).sum() for s in self.opt.variables
                             if s.name.startswith(n.replace("/", "_")) and tuple(s.shape) == tuple(by_name[n].shape)))
                 for n in self.names}
        self.rows.append((k, zeros, slots))


def _modified(recipe, optimizer, model=None, **compile_args):
    """``model`` (default :func:`_net`) under ``recipe``, compiled: ``(manager, model, callbacks)``."""
    manager = ScheduledModifierManager.from_yaml(recipe)
    model, callbacks = manager.modify(model or _net(), optimizer, steps_per_epoch=SPE)
    compile_args.setdefault("loss", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.compile(optimizer=compile_args.pop("optimizer_for_compile", optimizer), **compile_args)
    return manager, model, callbacks


def _train(recipe, optimizer, epochs=4, jit_compile=False, steps_per_execution=1, model=None, **fit):
    manager, model, callbacks = _modified(recipe, optimizer, model, jit_compile=jit_compile,
                                          steps_per_execution=steps_per_execution)
    record = _Record(model, optimizer, ["c1/kernel", "c2/kernel", "fc/kernel"])
    x, y = _data()
    model.fit(x, y, batch_size=32, epochs=epochs, callbacks=callbacks + [record], verbose=0, shuffle=False, **fit)
    return manager, model, record


PARITY = """
- !GradualKSModifier {params: [fc], init_sparsity: 0.1, final_sparsity: 0.7, start_epoch: 0.4, end_epoch: 2.0,
                      update_frequency: 0.4, leave_enabled: false}
- !ConstantKSModifier {params: [c1], start_epoch: 0.0, end_epoch: 1.6}
- !GradualKSModifier {params: [c2], init_sparsity: 0.3, final_sparsity: 0.6, start_epoch: 0.0, end_epoch: 1.0,
                      update_frequency: 0.2}
- !LearningRateModifier {lr_class: StepLR, lr_kwargs: {step_size: 1.0, gamma: 0.5}, init_lr: 0.02,
                         start_epoch: 0.0, end_epoch: 3.0}
"""


def _keras_parity_net():
    keras.utils.set_random_seed(1)
    inputs = keras.Input((8, 8, 1))
    x = keras.layers.Conv2D(8, 3, name="c1")(inputs)  # no ReLU: no weight keeps a zero by a dead unit's chance
    x = keras.layers.Conv2D(8, 3, name="c2")(x)
    return keras.Model(inputs, keras.layers.Dense(10, name="fc")(keras.layers.Flatten()(x)), name="parity")


class _Interrupt(keras.callbacks.Callback):
    """Raises after optimizer step ``at`` (a crash mid-epoch), once."""

    def __init__(self, at):
        super().__init__()
        self.at = at

    def on_train_batch_end(self, batch, logs=None):
        if self.at is not None and int(self.model.optimizer.iterations.numpy()) == self.at:
            self.at = None
            raise RuntimeError("interrupted")


def _block_to_int8(net, tmp_path, recipe=QAT):
    """``net`` QAT-trained, finalized, exported and converted (:func:`tests.support.keras_blocks.block_to_int8`), with
    nothing left float between integer ops."""
    manager, feeds, expected, result, ops = block_to_int8(net, tmp_path, recipe)
    assert not result.unconverted, result.unconverted
    return manager, feeds, expected, result, ops


def _assert_int8_within_a_step(result, feeds, expected) -> list:
    """The int8 model as written, in a default session and with optimizations off: within one output step of the
    Keras QAT model, every argmax the same; returns its outputs at each level."""
    ort = pytest.importorskip("onnxruntime")
    from tests.support.onnx_graphs import run

    step = float(np.diff(np.unique(expected)).min())
    outputs = []
    for level in (ort.GraphOptimizationLevel.ORT_ENABLE_ALL, ort.GraphOptimizationLevel.ORT_DISABLE_ALL):
        got = run(result.model, feeds, level=level, as_written=True)[0]
        assert np.abs(got - expected).max() <= step + 1e-6 and (got.argmax(1) == expected.argmax(1)).mean() == 1
        outputs.append(got)
    return outputs
