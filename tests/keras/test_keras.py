"""Keras 3: the recipe applied inside Keras's own train step (recal_keras)."""

import json
import os
import textwrap
import zipfile

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")

from recal_core import RecipeError, load_recipe  # noqa: E402
from recal_core.model_plan import plan_model  # noqa: E402
from recal_keras import RecalWarning, ScheduledModifierManager, export_onnx  # noqa: E402
from recal_keras.params import describe_model  # noqa: E402

from tests.support.paths import ROOT  # noqa: E402
from tests.support.forked import run_program  # noqa: E402
from tests.support.keras_blocks import (QAT, SPE, block_to_int8, densenet_block, efficientnet_block, mobilenet_block, mobilenet_v3_block,  # noqa: E402
                           residual_net)

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
        from tests.keras.test_keras import PRUNE, SPE, _data, _expected, _net
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


def test_same_recipe_same_zeros_and_lr_in_torch_tf_graph_and_keras():
    """One recipe, three backends, one model shape: after every step each layer holds the same number of
    zeros and the LR is the same (GradualKS released at its end, ConstantKS ending mid-run, StepLR)."""
    torch = pytest.importorskip("torch")
    from recal_tf import ScheduledModifierManager as GraphManager
    from recal_tf.utils import tf_compat
    from recal_torch import ScheduledModifierManager as TorchManager

    steps = 3 * SPE
    x, y = _data(SPE * 8)  # one epoch of batches of 8, fed again each epoch

    class TorchNet(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.c1, self.c2 = torch.nn.Conv2d(1, 8, 3), torch.nn.Conv2d(8, 8, 3)
            self.fc = torch.nn.Linear(8 * 4 * 4, 10)

        def forward(self, t):
            return self.fc(self.c2(self.c1(t)).flatten(1))

    torch.manual_seed(0)
    tnet = TorchNet()
    with torch.no_grad():
        tnet.c1.weight.view(-1)[:10] = 0
    tm = TorchManager.from_yaml(PARITY)
    topt = tm.modify(tnet, torch.optim.SGD(tnet.parameters(), lr=0.1, momentum=0.9), steps_per_epoch=SPE)

    graph = tf_compat.Graph()
    with graph.as_default():
        tf_compat.set_random_seed(0)
        gx = tf_compat.placeholder(tf.float32, [None, 8, 8, 1])
        gy = tf_compat.placeholder(tf.int64, [None])
        init = tf_compat.glorot_uniform_initializer()
        w1 = tf_compat.get_variable("c1/kernel", [3, 3, 1, 8], initializer=init, use_resource=True)
        w2 = tf_compat.get_variable("c2/kernel", [3, 3, 8, 8], initializer=init, use_resource=True)
        w3 = tf_compat.get_variable("fc/kernel", [128, 10], initializer=init, use_resource=True)
        h = tf.nn.conv2d(tf.nn.conv2d(gx, w1, 1, "VALID"), w2, 1, "VALID")
        logits = tf.matmul(tf.reshape(h, [-1, 128]), w3)
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=gy, logits=logits))
        step = tf_compat.train.get_or_create_global_step()
        gm = GraphManager.from_yaml(PARITY)
        ops, extras = gm.create_ops(steps_per_epoch=SPE)
        train = tf_compat.train.MomentumOptimizer(extras["learning_rate"], 0.9).minimize(loss, global_step=step)
        zero_first = tf.tensor_scatter_nd_update(tf.reshape(tf.transpose(w1, [3, 2, 0, 1]), [-1]),
                                                 tf.range(10)[:, None], tf.zeros(10))
        reset_w1 = w1.assign(tf.transpose(tf.reshape(zero_first, [8, 1, 3, 3]), [2, 3, 1, 0]))
        initializer = tf_compat.global_variables_initializer()
    sess = tf_compat.Session(graph=graph)
    sess.run(initializer)
    sess.run(reset_w1)
    gm.initialize_session(sess)

    knet = _keras_parity_net()
    k1 = knet.get_layer("c1").kernel
    flat = np.transpose(k1.numpy(), [3, 2, 0, 1]).reshape(-1)
    flat[:10] = 0
    k1.assign(np.transpose(flat.reshape(8, 1, 3, 3), [2, 3, 1, 0]))
    kopt = keras.optimizers.SGD(0.1, momentum=0.9)
    km = ScheduledModifierManager.from_yaml(PARITY)
    knet, callbacks = km.modify(knet, kopt, steps_per_epoch=SPE)
    knet.compile(optimizer=kopt, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    keras_rows = []

    class Rows(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            keras_rows.append([float(kopt.learning_rate.numpy())])

        def on_train_batch_end(self, batch, logs=None):
            keras_rows[-1].append([int((knet.get_layer(n).kernel.numpy() == 0).sum()) for n in ("c1", "c2", "fc")])

    knet.fit(x, y, batch_size=8, epochs=3, callbacks=callbacks + [Rows()], verbose=0, shuffle=False)

    nonzero_c1_seen = False
    for k in range(steps):
        b = k % SPE
        xb, yb = x[b * 8:(b + 1) * 8], y[b * 8:(b + 1) * 8]
        torch_lr = topt.param_groups[0]["lr"]
        topt.zero_grad()
        torch.nn.functional.cross_entropy(tnet(torch.from_numpy(xb).permute(0, 3, 1, 2)),
                                          torch.from_numpy(yb)).backward()
        topt.step()
        graph_lr = sess.run(extras["learning_rate"])
        sess.run(train, {gx: xb, gy: yb})
        sess.run(ops)
        torch_zeros = [int((m.weight == 0).sum()) for m in (tnet.c1, tnet.c2, tnet.fc)]
        graph_zeros = [int((sess.run(v) == 0).sum()) for v in (w1, w2, w3)]
        keras_lr, keras_zeros = keras_rows[k]
        assert torch_zeros == graph_zeros == keras_zeros, k
        assert torch_lr == pytest.approx(graph_lr) and graph_lr == pytest.approx(keras_lr), k
        nonzero_c1_seen |= torch_zeros[0] == 10
    assert nonzero_c1_seen and keras_rows[-1][1][0] < 10  # ConstantKS held the zeros, then let go
    assert keras_rows[-1][1][2] < round(0.7 * 1280)  # GradualKS released (leave_enabled: false)




@pytest.mark.parametrize("reduce_range", [False, True])
def test_qat_int8_onnx_equals_the_keras_qat_model_on_digits(tmp_path, reduce_range):
    """Prune, then QAT (Conv-BN-ReLU folded): the QDQ export and its int8 conversion classify the digits as
    the Keras QAT model does; before QAT starts the rewritten model computes exactly the float model. With
    reduce_range the weights are 7-bit: int8 within +-64 in the int8 model."""
    ort = pytest.importorskip("onnxruntime")
    pytest.importorskip("tf2onnx")
    from recal_core.datasets import load_digits
    from recal_onnx import quantize_qat_export
    from recal_app.keras_digits import digits_model

    digits = load_digits()
    x, y = digits.train_images[..., None], digits.train_labels
    xt, yt = digits.test_images[..., None], digits.test_labels
    model = digits_model(0)
    kernel = model.get_layer("conv1").kernel
    kernel.assign(kernel.numpy() * (np.arange(32) != 5))  # a channel pruned whole: GradualKS keeps its zeros, and
    beta = model.get_layer("bn1").beta  # its bias (BN's shift) must survive the int8 conversion: no tiny weight
    beta.assign(beta.numpy() + (np.arange(32) == 5))  # scale that would overflow the int32 bias
    opt = keras.optimizers.SGD(0.05, momentum=0.9)
    recipe = QAT.replace("freeze_bn_stats_epoch: 2.5", "freeze_bn_stats_epoch: 2.5, reduce_range: true") \
        if reduce_range else QAT
    manager = ScheduledModifierManager.from_yaml(recipe)
    qat, callbacks = manager.modify(model, opt, steps_per_epoch=45)
    assert manager.quantized_layers == ["conv0", "conv1", "conv2", "fc"]
    before = model.predict(xt, verbose=0)  # the float model, pruned as at step 0 (it shares the QAT model's weights)
    np.testing.assert_allclose(qat.predict(xt, verbose=0), before, rtol=1e-4, atol=1e-5)  # QAT not started yet
    qat.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    qat.fit(x, y, batch_size=32, epochs=3, callbacks=callbacks, verbose=0)
    manager.finalize(qat)
    keras_pred = qat.predict(xt, verbose=0).argmax(1)
    path = export_onnx(qat, tmp_path / "qat.onnx")
    import onnx
    from onnx import numpy_helper
    weight_scales = [numpy_helper.to_array(t) for t in onnx.load(path).graph.initializer if t.name.startswith("quant_scale")]
    assert len(weight_scales) == 4 and min(float(s.min()) for s in weight_scales) > 1e-5  # channel 5: 1/127
    from tests.support.onnx_graphs import assert_biases_on_grid

    assert_biases_on_grid(onnx.load(path), 4)  # each bias on its int32 grid, as recal_torch writes it
    result = quantize_qat_export(path, tmp_path / "int8.onnx")
    int8 = onnx.load(tmp_path / "int8.onnx")
    inits = {t.name: numpy_helper.to_array(t) for t in int8.graph.initializer}
    weights = [inits[n.input[3]] for n in int8.graph.node if n.op_type in ("QLinearConv", "QGemm")]
    largest = max(int(np.abs(w.astype(np.int16) - (128 if w.dtype == np.uint8 else 0)).max()) for w in weights)
    assert largest == (64 if reduce_range else 127)
    assert ("within +-64" in result.weights_note) == reduce_range
    preds = {}
    for name in ("qat.onnx", "int8.onnx"):
        sess = ort.InferenceSession(str(tmp_path / name))
        preds[name] = sess.run(None, {sess.get_inputs()[0].name: xt})[0].argmax(1)
    assert (keras_pred == yt).mean() > 0.9
    assert (preds["qat.onnx"] == keras_pred).mean() >= 0.997  # one digit in 360 may sit on a rounding edge
    assert (preds["int8.onnx"] == yt).mean() == pytest.approx((keras_pred == yt).mean(), abs=1 / 360)
    ops = {n.op_type for n in onnx.load(tmp_path / "int8.onnx").graph.node}
    assert "QLinearConv" in ops and not {"Conv", "MatMul", "Gemm"} & ops  # every conv and the dense are integer


@pytest.mark.slow
def test_qat_under_mirrored_strategy_keeps_replicas_in_sync(tmp_path):
    """Two virtual CPUs: each observer sees the global batch's range and BatchNorm's moving statistics are updated
    from the global batch, so every replica holds the same QAT state; the export converts to int8."""
    code = textwrap.dedent(f"""
        import numpy as np, tensorflow as tf
        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
        import keras
        from recal_core.datasets import load_digits
        from recal_onnx import quantize_qat_export
        from recal_keras import ScheduledModifierManager, export_onnx
        from recal_app.keras_digits import digits_model
        from tests.support.keras_blocks import QAT
        digits = load_digits()
        strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
        with strategy.scope():
            model = digits_model(0)
            opt = keras.optimizers.SGD(0.05, momentum=0.9)
            manager = ScheduledModifierManager.from_yaml(QAT)
            model, callbacks = manager.modify(model, opt, steps_per_epoch=10)
            model.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        model.fit(digits.train_images[:320, ..., None], digits.train_labels[:320], batch_size=32, epochs=3,
                  callbacks=callbacks, verbose=0)
        checked = 0
        for w in model.weights:
            if w.path.endswith(("min_val", "max_val", "moving_mean", "moving_variance")):
                first, second = (v.numpy() for v in w.value.values)
                assert np.array_equal(first, second), w.path
                checked += 1
        assert checked == 2 * 6 + 2 * 3, checked  # 6 observers, 3 BatchNorms
        manager.finalize(model)
        export_onnx(model, "{tmp_path}/qat.onnx")
        result = quantize_qat_export("{tmp_path}/qat.onnx", "{tmp_path}/int8.onnx")
        assert not result.unconverted
        print("replicas in sync")
    """)
    out = run_program(code=code, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "replicas in sync" in out.stdout


def test_finalized_before_qat_ran_is_left_float():
    """Finalized before QAT started: no range was ever observed, so the model is finalized float, computing what
    it computed with QAT off, and nothing is reported quantized."""
    from recal_app.keras_digits import digits_model

    model = digits_model(0)
    opt = keras.optimizers.SGD(0.01)
    manager = ScheduledModifierManager.from_yaml(QAT.replace("start_epoch: 1.0, freeze", "start_epoch: 2.0, freeze"))
    qat, callbacks = manager.modify(model, opt, steps_per_epoch=SPE)
    qat.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x, y = np.random.default_rng(0).random((SPE * 32, 8, 8, 1), np.float32), np.arange(SPE * 32) % 10
    qat.fit(x, y, batch_size=32, epochs=1, callbacks=callbacks, verbose=0)
    float_model = qat.predict(x[:16], verbose=0)  # step SPE: QAT not yet on
    with pytest.warns(RecalWarning, match=f"QAT had not run by step {SPE}, so the model is completed float"):
        manager.finalize(qat)
    assert manager.quantized_layers == []
    np.testing.assert_allclose(qat.predict(x[:16], verbose=0), float_model, rtol=1e-5, atol=1e-5)


def test_qat_refusals_and_float_layers_named():
    class Sub(keras.Model):
        def __init__(self):
            super().__init__(name="sub")
            self.d = keras.layers.Dense(4)

        def call(self, x):
            return self.d(x)

    sub = Sub()
    sub(np.zeros((1, 3), np.float32))
    with pytest.raises(RecipeError, match="cannot rebuild the subclassed model 'sub'.*Sequential or functional"):
        ScheduledModifierManager.from_yaml(QAT).modify(sub, keras.optimizers.Adam(), steps_per_epoch=SPE)
    with pytest.raises(RecipeError, match="ignore.*not available for Keras"):
        ScheduledModifierManager.from_yaml(QAT.replace("freeze_bn_stats_epoch: 2.5", "ignore: [fc]")).modify(
            _net(), keras.optimizers.Adam(), steps_per_epoch=SPE)
    inputs = keras.Input((8, 8, 1))
    x = keras.layers.DepthwiseConv2D(3, depth_multiplier=2, name="dw")(inputs)  # a multiplier: not quantized yet
    model = keras.Model(inputs, keras.layers.Dense(3, name="fc")(keras.layers.Flatten()(x)))
    with pytest.warns(RecalWarning, match="stay float.*dw"):
        ScheduledModifierManager.from_yaml(QAT).modify(model, keras.optimizers.Adam(), steps_per_epoch=SPE)


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


class _Interrupt(keras.callbacks.Callback):
    """Raises after optimizer step ``at`` (a crash mid-epoch), once."""

    def __init__(self, at):
        super().__init__()
        self.at = at

    def on_train_batch_end(self, batch, logs=None):
        if self.at is not None and int(self.model.optimizer.iterations.numpy()) == self.at:
            self.at = None
            raise RuntimeError("interrupted")


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


@pytest.fixture
def mixed_float16():
    keras.mixed_precision.set_global_policy("mixed_float16")
    yield
    keras.mixed_precision.set_global_policy("float32")


@pytest.mark.parametrize("wrapped", [False, True])
def test_mixed_float16_prunes_exactly_and_trains_qat(mixed_float16, wrapped):
    """mixed_float16: Keras wraps the optimizer in a LossScaleOptimizer at compile (or the user does); recal drives
    the inner one, masks stay exact per step, and QAT layers compute in float32 (the FakeQuant ops take no
    float16)."""
    opt = keras.optimizers.SGD(0.01, momentum=0.9)
    compiled = keras.optimizers.LossScaleOptimizer(opt) if wrapped else opt
    manager, model, callbacks = _modified(PRUNE + "- !QuantizationModifier {start_epoch: 2.0}\n", opt,
                                          optimizer_for_compile=compiled)
    assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
    record = _Record(model, opt, ["c1/kernel", "c2/kernel", "fc/kernel"])
    model.fit(*_data(), batch_size=32, epochs=4, callbacks=callbacks + [record], verbose=0, shuffle=False)
    assert len(record.rows) == 4 * SPE
    for k, zeros, slots in record.rows:
        assert zeros == _expected(PRUNE, model, k)[0], k
    assert model.get_layer("c1_qat").compute_dtype == "float32"
    manager.finalize(model)
    assert manager.quantized_layers == ["c1", "c2", "fc"]
    assert np.isfinite(model.predict(_data(64)[0], verbose=0)).all()


def test_a_qat_model_round_trips_a_keras_file_and_resumes_from_it(tmp_path):
    """``model.save(".keras")`` of a QAT model (ModelCheckpoint each epoch): each file loads with
    ``keras.models.load_model`` and computes what the model computed when it was saved, before QAT started
    (epoch 1: float) and during it (epoch 3); a new manager takes a loaded model on and the run ends as the
    uninterrupted one, from either file (BatchNorm frozen at 3.5 in both)."""
    x, y = _data()
    recipe = QAT.replace("end_epoch: 3.0}", "end_epoch: 4.0}").replace("start_epoch: 1.0, freeze_bn_stats_epoch: 2.5",
                                                                       "start_epoch: 2.0, freeze_bn_stats_epoch: 3.5")
    assert "freeze_bn_stats_epoch: 3.5" in recipe

    def modified(model=None):
        manager = ScheduledModifierManager.from_yaml(recipe)
        opt = keras.optimizers.SGD(0.01, momentum=0.9)
        qat, callbacks = manager.modify(model or _net(), opt if model is None else model.optimizer,
                                        steps_per_epoch=SPE)
        if model is None:
            qat.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return manager, qat, callbacks

    class Outputs(keras.callbacks.Callback):  # what the model computes when each file is written
        def __init__(self):
            super().__init__()
            self.at = {}

        def on_epoch_end(self, epoch, logs=None):
            self.at[epoch + 1] = self.model.predict(x, verbose=0)

    _, whole, callbacks = modified()
    whole.fit(x, y, batch_size=32, epochs=4, callbacks=callbacks, verbose=0, shuffle=False)
    _, first, callbacks = modified()
    outputs = Outputs()
    saver = keras.callbacks.ModelCheckpoint(str(tmp_path / "epoch-{epoch}.keras"))
    first.fit(x, y, batch_size=32, epochs=3, callbacks=callbacks + [saver, outputs], verbose=0, shuffle=False)
    for stop_epoch, quantizing in ((1, False), (3, True)):
        path = tmp_path / f"epoch-{stop_epoch}.keras"
        with zipfile.ZipFile(path) as saved:
            layers = json.loads(saved.read("config.json"))["config"]["layers"]
        assert [c["config"]["quantizing"] for c in layers if c["class_name"] == "QuantizedLayer"] == [quantizing] * 3
        loaded = keras.models.load_model(path)
        assert [type(layer).__name__ for layer in loaded.layers] == [type(layer).__name__ for layer in first.layers]
        np.testing.assert_array_equal(loaded.predict(x, verbose=0), outputs.at[stop_epoch])
        manager, resumed, callbacks = modified(loaded)
        assert resumed is loaded and manager.quantized_layers == ["c1", "c2", "fc"]
        resumed.fit(x, y, batch_size=32, epochs=4, initial_epoch=stop_epoch, callbacks=callbacks, verbose=0,
                    shuffle=False)
        for a, b in zip(whole.weights, resumed.weights):
            assert a.path == b.path
            np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-5, atol=1e-6, err_msg=f"{stop_epoch}: {a.path}")
            assert int((a.numpy() == 0).sum()) == int((b.numpy() == 0).sum()), (stop_epoch, a.path)


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


def test_depthwise_and_separable_convs_relu6_and_zero_padding_run_on_the_integers(tmp_path):
    """DepthwiseConv2D is fake-quantized per channel with its BatchNorm and ReLU6 folded in; a SeparableConv2D is
    its two convs, the depthwise output quantized between them and the BatchNorm folded into the pointwise one;
    zero padding passes the quantized tensor on: every conv, the pool and the dense are integer ops in the
    converted model, which computes the Keras QAT model's outputs (in a default session and with optimizations
    off)."""
    pytest.importorskip("tf2onnx")
    manager, feeds, expected, result, ops = _block_to_int8(mobilenet_block(), tmp_path)
    assert manager.quantized_layers == ["stem", "dw", "sep", "project", "fc"]
    assert ops.count("QLinearConv") == 5 and "QLinearGlobalAveragePool" in ops and "QGemm" in ops  # sep: two
    assert not {"Conv", "Clip", "Relu", "MatMul", "Pad", "GlobalAveragePool"} & set(ops)
    _assert_int8_within_a_step(result, feeds, expected)


def test_swish_sigmoid_and_squeeze_excitation_run_on_the_integers(tmp_path):
    """Swish (after a BatchNorm, or a conv's own) and sigmoid run on quantized tensors, each with an observer on
    its output (swish's sigmoid apart), and squeeze-excitation's Multiply of quantized tensors gets one: the int8
    model computes them with QLinearSigmoid and QLinearMul, and stays within an output step of the Keras QAT model
    (in a default session and with optimizations off)."""
    pytest.importorskip("tf2onnx")
    manager, feeds, expected, result, ops = _block_to_int8(efficientnet_block(), tmp_path)
    assert sorted(manager.quantized_layers) == sorted(["stem", "dw", "se_reduce", "se_expand", "se_excite",
                                                       "project", "add", "fc"])
    # the swish of stem, dw and se_reduce: a sigmoid and a product each; se_expand's sigmoid; the excitation's product
    assert ops.count("QLinearConv") == 5 and ops.count("QLinearSigmoid") == 4 and ops.count("QLinearMul") == 4
    assert ops.count("QLinearAdd") == 1 and ops.count("QLinearGlobalAveragePool") == 2 and "QGemm" in ops
    assert not {"Conv", "Sigmoid", "Mul", "MatMul", "GlobalAveragePool", "ReduceMean"} & set(ops), ops
    _assert_int8_within_a_step(result, feeds, expected)


def test_hard_swish_and_hard_sigmoid_run_on_the_integers_as_tables(tmp_path):
    """MobileNetV3's hard-swish (an Activation after a BatchNorm) and a hard-sigmoid (a conv's own activation)
    are quantized before and after as a whole; keras.applications' squeeze-excitation gate, ops on Keras tensors
    around a ReLU6 layer, is observed by the Multiply that reads it. onnxruntime has no integer kernel for these, so
    the converter makes each a 256-entry table of its input's integers (Gather), and the Multiply multiplies
    integers: nothing float, within an output step of the Keras QAT model (in a default session and with
    optimizations off)."""
    pytest.importorskip("tf2onnx")
    manager, feeds, expected, result, ops = _block_to_int8(mobilenet_v3_block(), tmp_path)
    assert sorted(manager.quantized_layers) == sorted(["stem", "dw", "se_reduce", "se_expand", "se_excite",
                                                       "project", "fc"])
    assert ops.count("QLinearConv") == 5 and result.rewrites["unary_to_table"] == 4, ops
    assert ops.count("QLinearMul") == 1
    assert ops.count("QLinearGlobalAveragePool") == 2 and "QGemm" in ops
    assert not {"Conv", "Clip", "Relu", "Mul", "Div", "HardSwish", "HardSigmoid", "GlobalAveragePool",
                "ReduceMean"} & set(ops), ops  # the classifier's bias Add after tf2onnx's Reshape stays float
    _assert_int8_within_a_step(result, feeds, expected)


def test_densenets_concatenations_pools_and_preactivation_batchnorms_run_on_the_integers(tmp_path):
    """A Concatenate of quantized tensors, an AveragePooling2D of one and a pre-activation BatchNorm (with its ReLU)
    of one each get one observer on their output: the int8 model concatenates and pools integers (QLinearConcat,
    QLinearAveragePool), and each pre-activation BatchNorm, which tf2onnx writes as a Mul and an Add on the
    channels-last tensor, becomes a depthwise QLinearConv with exact weights; within an output step of the Keras
    QAT model (in a default session and with optimizations off), whose finalized BatchNorms put their shifts on
    that conv's int32 grid."""
    pytest.importorskip("tf2onnx")
    manager, feeds, expected, result, ops = _block_to_int8(densenet_block(), tmp_path)
    # b1b_bn follows a conv: it folds into b1a; the other BatchNorms are pre-activation
    assert sorted(manager.quantized_layers) == sorted(["stem", "b1a_bn", "b1a", "b1b", "c1", "trans_bn", "trans",
                                                       "avg", "b2_bn", "b2", "c2", "top_bn", "fc"])
    assert ops.count("QLinearConv") == 9 and ops.count("QLinearConcat") == 2, ops  # 5 convs, 4 BatchNorms
    assert "QLinearAveragePool" in ops and "QLinearGlobalAveragePool" in ops and "QGemm" in ops
    assert not {"Conv", "AveragePool", "Relu", "Mul", "BatchNormalization"} & set(ops), ops
    for got in _assert_int8_within_a_step(result, feeds, expected):
        # the finalized BatchNorms' shifts on the int32 grid the int8 convs hold them on: the same numbers
        assert (np.abs(got - expected) <= 1e-6).mean() >= 0.99


def test_residual_adds_run_on_the_integers_and_round_trip_a_keras_file(tmp_path):
    """A residual Add of quantized tensors (and the ReLU after it) gets one observer on its output: the int8
    model adds integers (QLinearAdd); the stem's paddings and pool move integers; the softmax runs in float after
    the quantized Dense. The int8 model classifies as the Keras QAT model; the finalized model saved and loaded
    computes the same and exports the same int8 model."""
    pytest.importorskip("tf2onnx")
    ort = pytest.importorskip("onnxruntime")
    import onnx
    from recal_onnx import quantize_qat_export

    manager, model, callbacks = _modified(QAT, keras.optimizers.SGD(0.01, momentum=0.9), residual_net())
    assert sorted(manager.quantized_layers) == sorted(["stem", "res_a", "res_b", "shortcut", "add1", "expand", "dw",
                                                       "project", "add2", "fc"])
    x = np.random.default_rng(0).standard_normal((SPE * 32, 16, 16, 3)).astype(np.float32)
    y = np.random.default_rng(1).integers(0, 10, SPE * 32)
    model.fit(x, y, batch_size=32, epochs=3, callbacks=callbacks, verbose=0, shuffle=False)
    manager.finalize(model)
    expected = model.predict(x, verbose=0)
    model.save(tmp_path / "qat.keras")
    loaded = keras.models.load_model(tmp_path / "qat.keras")  # finalized: the export's form, biases on their grid
    np.testing.assert_array_equal(loaded.predict(x, verbose=0), expected)
    export_onnx(model, tmp_path / "qat.onnx")
    result = quantize_qat_export(tmp_path / "qat.onnx", tmp_path / "int8.onnx")
    assert not result.unconverted
    export_onnx(loaded, tmp_path / "loaded.onnx")  # the loaded model exports the same int8 model
    quantize_qat_export(tmp_path / "loaded.onnx", tmp_path / "loaded.int8.onnx")
    runs = [ort.InferenceSession(str(tmp_path / f)) for f in ("int8.onnx", "loaded.int8.onnx")]
    np.testing.assert_array_equal(*(r.run(None, {r.get_inputs()[0].name: x})[0] for r in runs))
    ops = [n.op_type for n in onnx.load(tmp_path / "int8.onnx").graph.node]
    assert ops.count("QLinearAdd") == 2 and ops.count("QLinearConv") == 7 and "QGemm" in ops
    assert not {"Conv", "Relu", "Clip", "MatMul"} & set(ops) and {"Pad", "MaxPool", "Softmax"} <= set(ops)
    session = ort.InferenceSession(str(tmp_path / "int8.onnx"))
    got = session.run(None, {session.get_inputs()[0].name: x})[0]
    # probabilities: a logit one output step off (onnxruntime's own rounding) moves them by about 1e-3
    assert np.abs(got - expected).max() < 5e-3 and (got.argmax(1) == expected.argmax(1)).mean() == 1


def test_evaluated_when_qat_starts_before_any_range_is_observed_it_computes_the_float_activations():
    """Evaluated at the step QAT starts, before a training step has observed a range (Keras's validation at the end
    of the epoch before QAT; ``recal train``'s test accuracy there), the activations pass as they are: there is no
    range to quantize them with yet. (They were quantized to an empty range, and every digit got one class.)"""
    from recal_app.keras_digits import digits_model

    model = digits_model(0)
    opt = keras.optimizers.SGD(0.01)
    manager = ScheduledModifierManager.from_yaml(QAT)  # QAT from epoch 1
    qat, callbacks = manager.modify(model, opt, steps_per_epoch=SPE)
    qat.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x, y = np.random.default_rng(0).random((SPE * 32, 8, 8, 1), np.float32), np.arange(SPE * 32) % 10
    qat.fit(x, y, batch_size=32, epochs=1, callbacks=callbacks, verbose=0)
    at_start = qat.predict(x[:64], verbose=0)  # step SPE: QAT on, nothing observed yet
    float_model = model.predict(x[:64], verbose=0)  # the same layers, unwrapped
    assert np.ptp(at_start) > 0.1 * np.ptp(float_model)  # not one value for every input
    np.testing.assert_allclose(at_start, float_model, atol=0.05 * np.ptp(float_model))  # weights fake-quantized only
    qat.fit(x, y, batch_size=32, epochs=2, initial_epoch=1, callbacks=callbacks, verbose=0)
    assert not np.allclose(qat.predict(x[:64], verbose=0), model.predict(x[:64], verbose=0), atol=1e-6)  # QAT now


def test_learned_scales_on_depthwise_and_separable_convs_convert_exactly(tmp_path):
    """``observer: lsq`` on a MobileNet's pieces: the depthwise kernel's per-channel scales and both kernels of a
    separable conv learn theirs (8 scale sets in all), and the int8 model computes the Keras QAT model's outputs."""
    pytest.importorskip("tf2onnx")
    lsq = QAT.replace("freeze_bn_stats_epoch: 2.5}", "freeze_bn_stats_epoch: 2.5, scheme: {input_activations: "
                      "{symmetric: false, observer: lsq}, weights: {observer: lsq}}}")
    assert "lsq" in lsq
    manager, feeds, expected, result, ops = _block_to_int8(mobilenet_block(), tmp_path, lsq)
    learned = [w.path for layer in manager._model.layers for w in layer.weights if w.name == "log_ratio"]
    assert len(learned) == 8 and any("sep_depthwise_scales" in p for p in learned), learned
    assert result.verification.max_abs_diff <= result.verification.output_range / 255, result.verification
    assert {"QLinearConv", "QGemm"} <= set(ops)
