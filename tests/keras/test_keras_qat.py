"""Keras QAT: the int8 model computes what the QAT model does, replicas in sync, refusals and float layers named, mixed
precision, a QAT model through a .keras file."""

import json
import textwrap
import zipfile
import numpy as np
import pytest
tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")
from recal_core import RecipeError  # noqa: E402
from recal_keras import RecalWarning, ScheduledModifierManager, export_onnx  # noqa: E402
from tests.support.paths import ROOT  # noqa: E402
from tests.support.forked import run_program  # noqa: E402
from tests.support.keras_blocks import QAT, SPE  # noqa: E402
from tests.keras.keras_models import PRUNE, _Record, _data, _expected, _modified, _net  # noqa: E402


@pytest.fixture
def mixed_float16():
    keras.mixed_precision.set_global_policy("mixed_float16")
    yield
    keras.mixed_precision.set_global_policy("float32")


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
