"""Keras 3 on TensorFlow: the recipe applied inside Keras's own train step (pruning exact after every step, LR, weight
decay, trainable flags, resume, export), under tf.distribute strategies, and what is refused."""

import json
import os
import textwrap
import zipfile
import numpy as np
import pytest
tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")
from recal_core import RecipeError  # noqa: E402
from recal_keras import RecalWarning, ScheduledModifierManager, export_onnx  # noqa: E402
from recal_keras.params import describe_model  # noqa: E402
from tests.support.paths import ROOT  # noqa: E402
from tests.support.forked import run_program  # noqa: E402
from tests.support.keras_blocks import SPE  # noqa: E402
from tests.keras.keras_models import PRUNE, _Interrupt, _data, _expected, _modified, _net, _train  # noqa: E402


@pytest.mark.parametrize("optimizer,jit_compile,steps_per_execution",
                         [("adam", False, 1), ("sgd", False, 1), ("adam", True, 1), ("sgd", False, 3)])
def test_pruning_exact_after_every_step(optimizer, jit_compile, steps_per_execution):
    opt = keras.optimizers.Adam(1e-3) if optimizer == "adam" else keras.optimizers.SGD(0.01, momentum=0.9)
    manager, model, record = _train(PRUNE, opt, jit_compile=jit_compile, steps_per_execution=steps_per_execution)
    assert len(record.rows) == 4 * -(-SPE // steps_per_execution)  # Keras runs whole executions within an epoch
    for k, zeros, slots in record.rows:
        expected, lr = _expected(PRUNE, model, k)
        assert zeros == expected, k
        assert slots == {n: 0 for n in slots}, k  # no optimizer state on a pruned weight
    assert record.rows[-1][1]["fc/kernel"] == round(0.8 * 1280)
    sparsity = manager.finalize(model)
    assert sparsity["c1/kernel"] == pytest.approx(58 / 72)


def test_learning_rate_from_the_recipe_in_graph():
    opt = keras.optimizers.SGD(0.5)
    lrs = []

    class LR(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            lrs.append(float(opt.learning_rate.numpy()))

    _, model, callbacks = _modified(PRUNE, opt)
    model.fit(*_data(), batch_size=32, epochs=3, callbacks=callbacks + [LR()], verbose=0)
    assert lrs == pytest.approx([_expected(PRUNE, model, k)[1] for k in range(3 * SPE)])
    assert isinstance(opt._learning_rate, keras.Variable)  # Keras saves, loads and logs it as usual
    assert lrs[0] == pytest.approx(0.01) and lrs[-1] == pytest.approx(0.01 * 0.8 ** 2)


def test_weight_decay_from_the_recipe_in_graph(tmp_path):
    """SetWeightDecay at epoch 1: with a zero loss, SGD only decays: w <- w (1 - lr wd) from step SPE on."""
    recipe = "- !SetWeightDecayModifier {weight_decay: 0.5, start_epoch: 1.0}\n" \
             "- !EpochRangeModifier {start_epoch: 0.0, end_epoch: 2.0}"
    _, model, callbacks = _modified(recipe, keras.optimizers.SGD(0.1), loss=lambda y, p: 0.0 * keras.ops.sum(p),
                                    steps_per_execution=2)
    before = model.get_layer("fc").kernel.numpy().copy()
    optimizer = model.optimizer
    assert float(optimizer.weight_decay) == 0.0 and optimizer.get_config()["weight_decay"] == 0.0
    model.fit(*_data(), batch_size=32, epochs=1, callbacks=callbacks, verbose=0)
    np.testing.assert_allclose(model.get_layer("fc").kernel.numpy(), before, rtol=1e-6)
    # the decay in force for the next step, as Python reads it, in the optimizer's config and in a .keras file
    assert float(optimizer.weight_decay) == 0.5 and repr(optimizer.weight_decay) == "0.5"
    assert json.loads(json.dumps(optimizer.get_config()))["weight_decay"] == 0.5
    model.save(tmp_path / "decayed.keras")
    with zipfile.ZipFile(tmp_path / "decayed.keras") as saved:
        compiled = json.loads(saved.read("config.json"))["compile_config"]
    assert compiled["optimizer"]["config"]["weight_decay"] == 0.5
    model.fit(*_data(), batch_size=32, epochs=2, initial_epoch=1, callbacks=callbacks, verbose=0)
    np.testing.assert_allclose(model.get_layer("fc").kernel.numpy(), before * (1 - 0.1 * 0.5) ** SPE, rtol=1e-5)


def test_trainable_params_flip_each_epoch():
    recipe = "- !TrainableParamsModifier {params: [c1], trainable: false, start_epoch: 1.0, end_epoch: 2.0}\n" \
             "- !EpochRangeModifier {start_epoch: 0.0, end_epoch: 3.0}"
    manager, model, callbacks = _modified(recipe, keras.optimizers.SGD(0.1))
    snapshots = []

    class Snap(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            snapshots.append((model.get_layer("c1").kernel.numpy().copy(), model.get_layer("c2").kernel.numpy().copy()))

    start = (model.get_layer("c1").kernel.numpy().copy(), model.get_layer("c2").kernel.numpy().copy())
    model.fit(*_data(), batch_size=32, epochs=3, callbacks=callbacks + [Snap()], verbose=0)
    moved = [[not np.array_equal(a[i], b[i]) for i in (0, 1)] for a, b in zip([start] + snapshots, snapshots)]
    assert moved == [[True, True], [False, True], [True, True]]
    manager.finalize(model)
    assert model.get_layer("c1").kernel.trainable


def test_resume_from_a_keras_file_continues_exactly(tmp_path):
    """Two epochs, save the .keras file, load it with a new manager, two more: the same as four at once."""
    whole = _train(PRUNE, keras.optimizers.Adam(1e-3), epochs=4)[1]
    manager, model, _ = _train(PRUNE, keras.optimizers.Adam(1e-3), epochs=2)
    model.save(tmp_path / "mid.keras")
    loaded = keras.models.load_model(tmp_path / "mid.keras")
    second = ScheduledModifierManager.from_yaml(PRUNE)
    loaded, callbacks = second.modify(loaded, loaded.optimizer, steps_per_epoch=SPE)
    loaded.fit(*_data(), batch_size=32, epochs=4, initial_epoch=2, callbacks=callbacks, verbose=0, shuffle=False)
    for a, b in zip(whole.weights, loaded.weights):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-5, atol=1e-6, err_msg=a.path)
        assert int((a.numpy() == 0).sum()) == int((b.numpy() == 0).sum()), a.path


def test_finalize_and_export_onnx_match_keras(tmp_path):
    ort = pytest.importorskip("onnxruntime")
    pytest.importorskip("tf2onnx")
    manager, model, _ = _train(PRUNE, keras.optimizers.Adam(1e-3), epochs=4)
    sparsity = manager.finalize(model)
    assert all(v.constraint is None for v in model.weights)
    path = export_onnx(model, tmp_path / "model.onnx")
    x = _data(16, seed=1)[0]
    sess = ort.InferenceSession(path)
    got = sess.run(None, {sess.get_inputs()[0].name: x})[0]
    np.testing.assert_allclose(got, model.predict(x, verbose=0), rtol=1e-4, atol=1e-4)
    import onnx
    from onnx import numpy_helper
    zeros = sorted(float((numpy_helper.to_array(t) == 0).mean()) for t in onnx.load(path).graph.initializer
                   if numpy_helper.to_array(t).size in (72, 576, 1280))
    assert zeros == pytest.approx(sorted(sparsity.values()))
    assert [p.name for p in tmp_path.iterdir()] == ["model.onnx"]


def test_an_export_feeds_on_the_models_inputs_only(tmp_path):
    """A Normalization layer (keras.applications' EfficientNets) holds its mean and variance as eager tensors,
    which Keras's ONNX export writes as inputs nobody feeds: recal's export writes them as constants, and the ONNX
    model computes what Keras does. A layer holding other such constants is refused, and nothing is written."""
    ort = pytest.importorskip("onnxruntime")
    pytest.importorskip("tf2onnx")

    inputs = keras.Input((4,))
    x = keras.layers.Normalization(mean=[1.0, 2.0, 3.0, 4.0], variance=[1.0, 4.0, 9.0, 16.0])(inputs)
    model = keras.Model(inputs, keras.layers.Dense(3, name="fc")(x))
    x = np.random.default_rng(0).standard_normal((8, 4)).astype(np.float32)
    expected = model.predict(x, verbose=0)
    session = ort.InferenceSession(export_onnx(model, tmp_path / "norm.onnx"))
    assert len(session.get_inputs()) == 1
    np.testing.assert_allclose(session.run(None, {session.get_inputs()[0].name: x})[0], expected, rtol=1e-5,
                               atol=1e-6)

    class Offset(keras.layers.Layer):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.offset = tf.constant(np.arange(4, dtype=np.float32))  # an eager tensor, not a weight

        def call(self, x):
            return x + self.offset

    inputs = keras.Input((4,))
    offset = keras.Model(inputs, Offset(name="offset")(inputs), name="with_offset")
    offset.predict(x, verbose=0)
    with pytest.raises(ValueError, match="'with_offset'.* takes 2 inputs where the model takes 1"):
        export_onnx(offset, tmp_path / "offset.onnx")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["norm.onnx"]


def test_subclassed_model_prunes_in_place():
    class Net(keras.Model):
        def __init__(self):
            super().__init__(name="sub")
            self.a = keras.layers.Dense(32, activation="relu", name="a")
            self.b = keras.layers.Dense(10, name="b")

        def call(self, x):
            return self.b(self.a(keras.ops.reshape(x, (-1, 64))))

    model = Net()
    model(np.zeros((1, 8, 8, 1), np.float32))
    recipe = "- !ConstantKSModifier {params: [a], start_epoch: 0.0, end_epoch: 1.0}\n" \
             "- !GradualKSModifier {params: [b/kernel], init_sparsity: 0.5, final_sparsity: 0.5, start_epoch: 0.0, " \
             "end_epoch: 1.0, update_frequency: 1.0}"
    model.a.kernel.assign(model.a.kernel.numpy() * (np.arange(64 * 32).reshape(64, 32) % 3 != 0))
    _, model, callbacks = _modified(recipe, keras.optimizers.Adam(1e-2), model)
    model.fit(*_data(), batch_size=32, epochs=1, callbacks=callbacks, verbose=0)
    assert int((model.a.kernel.numpy() == 0).sum()) == int((np.arange(64 * 32) % 3 == 0).sum())
    assert int((model.b.kernel.numpy() == 0).sum()) == 160


def test_recipe_naming_a_missing_layer_says_which():
    with pytest.raises(RecipeError) as err:
        ScheduledModifierManager.from_yaml(PRUNE.replace("__ALL_PRUNABLE__", "[c3]")).modify(
            _net(), keras.optimizers.Adam(), steps_per_epoch=SPE)
    message = str(err.value)
    assert "c3" in message and "GradualKSModifier" in message and "c1" in message  # the closest names


def test_unbuilt_model_and_wrong_optimizer_are_refused():
    unbuilt = keras.Sequential([keras.layers.Dense(3)])
    with pytest.raises(ValueError, match="no weights yet: build it first"):
        ScheduledModifierManager.from_yaml(PRUNE).modify(unbuilt, keras.optimizers.Adam(), steps_per_epoch=SPE)
    model = _net()
    model, callbacks = ScheduledModifierManager.from_yaml(PRUNE).modify(model, keras.optimizers.Adam(),
                                                                        steps_per_epoch=SPE)
    model.compile(optimizer=keras.optimizers.Adam(), loss="sparse_categorical_crossentropy")
    with pytest.raises(ValueError, match="compiled with another optimizer"):
        model.fit(*_data(), epochs=1, callbacks=callbacks, verbose=0)


def test_gradient_accumulation_is_refused():
    with pytest.raises(ValueError, match="accumulates gradients over 4 batches"):
        ScheduledModifierManager.from_yaml(PRUNE).modify(_net(), keras.optimizers.Adam(gradient_accumulation_steps=4),
                                                         steps_per_epoch=SPE)


def test_epoch_length_mismatch_is_warned():
    _, model, callbacks = _modified(PRUNE, keras.optimizers.Adam())
    with pytest.warns(RecalWarning, match="ran 3 steps, but the recipe was bound with steps_per_epoch=5"):
        model.fit(*_data(96), batch_size=32, epochs=1, callbacks=callbacks, verbose=0)


@pytest.mark.slow
def test_mirrored_strategy_two_replicas_exact():
    """Two virtual CPU devices (they must be set before TensorFlow starts: a subprocess)."""
    code = textwrap.dedent(f"""
        import numpy as np, tensorflow as tf
        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
        import keras
        from tests.keras.keras_models import PRUNE, SPE, _data, _expected, _net
        from recal_keras import ScheduledModifierManager
        strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
        with strategy.scope():
            model = _net()
            opt = keras.optimizers.SGD(0.01, momentum=0.9)
            model, callbacks = ScheduledModifierManager.from_yaml(PRUNE).modify(model, opt, steps_per_epoch=SPE)
            model.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        rows = []
        class Check(keras.callbacks.Callback):
            def on_train_batch_end(self, batch, logs=None):
                k = int(opt.iterations.numpy())
                expected = _expected(PRUNE, model, k)[0]
                for layer in ("c1", "c2", "fc"):
                    for replica in model.get_layer(layer).kernel.value.values:
                        assert int((replica.numpy() == 0).sum()) == expected[layer + "/kernel"], (k, layer)
                rows.append(k)
        model.fit(*_data(), batch_size=32, epochs=4, callbacks=callbacks + [Check()], verbose=0)
        assert rows == list(range(1, 4 * {SPE} + 1)), rows
        print("replicas exact")
    """)
    out = run_program(code=code, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "replicas exact" in out.stdout


@pytest.mark.slow
def test_a_recipe_under_multi_worker_mirrored_strategy_runs_as_in_one_process(tmp_path):
    """Two workers on localhost (``MultiWorkerMirroredStrategy``, a custom loop: Keras 3's ``fit`` fails under this
    strategy for any model): pruning, LR and QAT give both workers the same weights, masks and observed ranges,
    those of the same run in one process on the whole batches."""
    import subprocess
    import sys

    from tests.support.ports import free_ports

    ports = ",".join(str(p) for p in free_ports(2))
    command = [sys.executable, "-m", "tests.support.keras_multiworker_run"]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    workers = [subprocess.Popen(command + [str(i), ports, str(tmp_path)], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True) for i in (0, 1)]
    single = subprocess.run(command + ["0", "0", str(tmp_path)], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=300)
    outputs = [w.communicate(timeout=300)[0] for w in workers]
    assert [w.returncode for w in workers] == [0, 0], "\n".join(o[-2000:] for o in outputs)
    assert single.returncode == 0, single.stderr[-2000:]
    first, second, alone = (np.load(tmp_path / name) for name in ("w0_2.npz", "w1_2.npz", "w0_1.npz"))
    assert any("input_q" in k for k in first.files) and float(first["lr"]) == pytest.approx(0.1 * 0.5 ** 2)
    for key in first.files:
        assert np.array_equal(first[key], second[key]), key
        np.testing.assert_allclose(first[key], alone[key], rtol=1e-5, atol=1e-6, err_msg=key)
    kernel = next(first[k] for k in first.files if k.endswith("d1/kernel"))
    assert abs(float((kernel == 0).mean()) - 0.6) < 0.02


def test_model_outside_the_strategy_scope_is_refused():
    model = _net()
    strategy = tf.distribute.OneDeviceStrategy("/cpu:0")
    with strategy.scope(), pytest.raises(ValueError, match="built outside the current tf.distribute strategy"):
        ScheduledModifierManager.from_yaml(PRUNE).modify(model, keras.optimizers.Adam(), steps_per_epoch=SPE)


def test_a_pruned_layer_replaced_after_modify_is_named_before_training_goes_on():
    """A subclassed model whose pruned Dense is swapped after modify() (Keras itself refuses that on a built
    model; code can go around it): fit refuses it at its start (and at every epoch's), naming the weight, rather
    than train the new layer unpruned while the masks go to the old one."""

    class Net(keras.Model):
        def __init__(self):
            super().__init__(name="swapped")
            self.fc = keras.layers.Dense(10, name="fc")

        def call(self, x):
            return self.fc(keras.ops.reshape(x, (-1, 64)))

    model = Net()
    model(np.zeros((1, 8, 8, 1), np.float32))
    optimizer = keras.optimizers.SGD(0.01)
    manager, model, callbacks = _modified(PRUNE, optimizer, model)
    x, y = _data()
    model.fit(x, y, batch_size=32, epochs=1, callbacks=callbacks, verbose=0)
    old = model.fc  # Keras refuses new layers on a built model; code that goes around it is caught here
    model._tracker.unlock()
    model.fc = keras.layers.Dense(10, name="fc2")
    model._layers.remove(old)
    model(np.zeros((1, 8, 8, 1), np.float32))
    with pytest.raises(ValueError, match=r"pruned weights are no longer part of model 'swapped': .*fc.*replaced"):
        model.fit(x, y, batch_size=32, epochs=1, callbacks=callbacks, verbose=0)
    with pytest.raises(ValueError, match="no longer part of model"):
        manager.finalize(model)


def test_a_gradient_tape_loop_follows_the_recipe_from_its_first_step():
    """The custom-loop recipe of docs/keras.md: masks and LR come with optimizer.apply_gradients (Keras applies the
    constraint recal sets), from the very first step; the callbacks run through keras.callbacks.CallbackList."""
    optimizer = keras.optimizers.SGD(0.5, momentum=0.9)  # 0.5: the recipe's 0.01 must replace it before step 1
    manager = ScheduledModifierManager.from_yaml(PRUNE)
    model, callbacks = manager.modify(_net(), optimizer, steps_per_epoch=SPE)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    @tf.function
    def train_step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))

    callback_list = keras.callbacks.CallbackList(callbacks, model=model)
    x, y = _data()
    names = ["c1/kernel", "c2/kernel", "fc/kernel"]
    callback_list.on_train_begin()
    for epoch in range(manager.max_epochs):
        callback_list.on_epoch_begin(epoch)
        for b in range(SPE):
            k = int(optimizer.iterations.numpy())
            assert float(optimizer.learning_rate.numpy()) == pytest.approx(_expected(PRUNE, model, k)[1]), k
            train_step(x[b * 32:(b + 1) * 32], y[b * 32:(b + 1) * 32])
            _, by_name = describe_model(model)
            zeros = {n: int((by_name[n].numpy() == 0).sum()) for n in names}
            assert zeros == _expected(PRUNE, model, k + 1)[0], k + 1
        callback_list.on_epoch_end(epoch)
    callback_list.on_train_end()
    assert manager.finalize(model)["fc/kernel"] == pytest.approx(0.8)


@pytest.mark.parametrize("recal_first", [True, False])
def test_backup_and_restore_resumes_to_the_uninterrupted_weights_in_any_order(tmp_path, recal_first):
    """fit with BackupAndRestore crashes mid-epoch 3 (its backup is of epoch 2's end). Retried in the same process
    with the same callbacks, and restarted as a new process would (a new model and manager): the weights equal an
    uninterrupted run's, whether recal's callback comes before BackupAndRestore or after."""
    whole = _train(PRUNE, keras.optimizers.Adam(1e-3), epochs=4)[1]

    def fit(model, callbacks, interrupt):
        backup = keras.callbacks.BackupAndRestore(str(tmp_path / "backup"))
        ordered = callbacks + [backup] if recal_first else [backup] + callbacks
        model.fit(*_data(), batch_size=32, epochs=4, callbacks=ordered + [interrupt], verbose=0, shuffle=False)

    for restart in ("retry", "new model"):
        _, model, callbacks = _modified(PRUNE, keras.optimizers.Adam(1e-3))
        interrupt = _Interrupt(2 * SPE + 3)
        with pytest.raises(RuntimeError, match="interrupted"):
            fit(model, callbacks, interrupt)
        if restart == "new model":
            _, model, callbacks = _modified(PRUNE, keras.optimizers.Adam(1e-3))
        fit(model, callbacks, interrupt)
        assert int(model.optimizer.iterations.numpy()) == 4 * SPE
        for a, b in zip(whole.weights, model.weights):
            np.testing.assert_array_equal(a.numpy(), b.numpy(), err_msg=f"{restart}: {a.path}")
