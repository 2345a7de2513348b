"""Keras 3 on its TensorFlow, JAX and PyTorch backends: one recipe, the same masks, LR and weight decay at every step;
prune + QAT exported by each backend's exporter to an int8 model that computes what the Keras QAT model does; what a
backend cannot run is refused at ``modify``, located in the recipe."""

import os
import subprocess
import sys

import numpy as np
import pytest

keras = pytest.importorskip("keras")
pytest.importorskip("tensorflow")

from recal_core import RecipeError  # noqa: E402
from recal_keras import ScheduledModifierManager  # noqa: E402

from tests.support import keras_backend_run  # noqa: E402
from tests.support.paths import ROOT  # noqa: E402


def _run_on(backend: str, out, onnx_path, qat_out) -> subprocess.Popen:
    """Both recipes run on ``backend`` in a fresh interpreter (a process's Keras backend is fixed at import)."""
    env = {**os.environ, "KERAS_BACKEND": backend, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, "-m", "tests.support.keras_backend_run", str(out), str(onnx_path), str(qat_out)],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@pytest.mark.slow
def test_the_same_recipes_prune_alike_and_quantize_to_int8_on_every_keras_backend(tmp_path):
    """Unstructured, 2:4 and block pruning (one released mid-run), an exponential LR and a weight decay from epoch 1:
    after every step JAX and PyTorch hold exactly TensorFlow's zeros and ran at its LR and decay, and neither
    imported TensorFlow for recal; each backend's ONNX export (tf2onnx, jax2onnx, torch.onnx) computes what its
    Keras model does and holds the pruned zeros; a run resumed from the ``.keras`` file of epoch 2 with a new manager
    ends on the same weights, bit for bit. The same processes run prune + QAT: :func:`_check_qat`, and
    keras.applications' pieces: :func:`_check_blocks`."""
    pytest.importorskip("jax")
    pytest.importorskip("torch")
    others = {b: _run_on(b, tmp_path / f"{b}.npz", tmp_path / f"{b}.onnx", tmp_path / f"{b}_qat.npz")
              for b in ("jax", "torch")}
    keras_backend_run.run(str(tmp_path / "tensorflow.npz"), str(tmp_path / "tensorflow.onnx"), resume=False)
    keras_backend_run.run_qat(str(tmp_path / "tensorflow_qat.npz"))
    for backend, process in others.items():
        output, _ = process.communicate(timeout=600)
        assert process.returncode == 0, output[-3000:]
    ran = {b: np.load(tmp_path / f"{b}.npz") for b in ("tensorflow", "jax", "torch")}
    tf_run = ran["tensorflow"]
    assert str(tf_run["backend"]) == "tensorflow" and len(tf_run["step"]) == 4 * keras_backend_run.STEPS_PER_EPOCH
    zeros = {name: np.unpackbits(tf_run[name], axis=1).sum(axis=1) for name in keras_backend_run.PRUNED}
    assert zeros["fc/kernel"].max() > 0 and zeros["fc/kernel"][-1] == 0  # block pruning ran, then was released
    assert zeros["conv2/kernel"][-1] == zeros["conv2/kernel"].max() > 0  # 2:4
    assert len(set(tf_run["lr"])) > 2
    assert tf_run["weight_decay"][0] == 0 and tf_run["weight_decay"][-1] == np.float32(0.002)
    for backend in ("jax", "torch"):
        other = ran[backend]
        assert str(other["backend"]) == backend and not other["tensorflow_imported"]
        np.testing.assert_array_equal(other["step"], tf_run["step"])
        np.testing.assert_array_equal(other["lr"], tf_run["lr"])
        np.testing.assert_array_equal(other["weight_decay"], tf_run["weight_decay"])
        for name in keras_backend_run.PRUNED:  # the zero positions after each step, bit for bit
            np.testing.assert_array_equal(other[name], tf_run[name], err_msg=f"{backend} {name}")
        np.testing.assert_allclose(other["fc"], tf_run["fc"], atol=1e-5)  # the same training, decay included
        assert other["onnx_error"] < 1e-5 and other["onnx_zeros"] == tf_run["onnx_zeros"]  # its exporter's ONNX
        assert other["resume_error"] == 0  # resumed from a .keras file of epoch 2: bit for bit
    assert tf_run["onnx_error"] < 1e-5  # TensorFlow's resume from .keras: tests/keras/test_keras_qat.py
    assert tf_run["onnx_zeros"] >= sum(z[-1] for z in zeros.values())
    _check_qat({b: np.load(tmp_path / f"{b}_qat.npz") for b in ("tensorflow", "jax", "torch")})
    _check_blocks({b: np.load(tmp_path / f"{b}_qat_blocks.npz") for b in ("jax", "torch")})
    for backend in ("jax", "torch"):  # weights an exporter writes beside the model: back in the one file written
        large = np.load(tmp_path / f"{backend}_qat_large.npz")
        assert large["files"].tolist() == ["large.onnx"] and float(large["error"]) < 1e-5, backend


def _check_qat(ran: dict) -> None:
    """Prune + QAT from epoch 1, BatchNorm frozen at 2.5: on every backend QAT starts and BatchNorm freezes at the
    recipe's steps (JAX reads a step count of the model's own), the export converts to an int8 model whose convs and
    dense layer all run on the integers and which computes the Keras QAT model's outputs within one output step (the
    same classes), the ``.keras`` file reloads to the same outputs, and the three backends learned alike."""
    steps = keras_backend_run.QAT_STEPS_PER_EPOCH
    accuracies = []
    for backend, run in ran.items():
        assert str(run["backend"]) == backend
        assert int(np.argmax(run["observed"] > 0)) == steps  # the first step of epoch 1 observed the ranges
        means = np.array([m.sum() for m in run["bn0_mean"]])
        assert np.nonzero(np.diff(means))[0].max() + 1 == int(2.5 * steps) - 1  # moving stats fixed from step 30
        ops = set(run["int8_ops"].tolist())
        assert "QLinearConv" in ops and "QGemm" in ops and not {"Conv", "MatMul", "Gemm", "ReduceMean"} & ops, backend
        keras_out, int8 = run["keras"], run["int8"]
        assert np.abs(int8 - keras_out).max() <= 1.01 * float(run["output_step"]), backend
        assert (int8.argmax(1) == keras_out.argmax(1)).all(), backend
        np.testing.assert_allclose(run["reloaded"], keras_out, atol=1e-6)
        accuracies.append((keras_out.argmax(1) == run["labels"]).mean())
    assert min(accuracies) > 0.5 and max(accuracies) - min(accuracies) < 0.03  # 36 steps: the same learning


def _check_blocks(ran: dict) -> None:
    """keras.applications' pieces (depthwise and separable convs, ReLU6, zero padding, swish, squeeze-excitation,
    residual Adds, concatenation, average pooling, pre-activation BatchNorms, hard-swish) QAT-trained on JAX and PyTorch and
    exported by their exporters: the int8 model holds the integer ops TensorFlow's export gives
    (:mod:`tests.keras.test_keras_qat_blocks`), nothing float between them, and computes the Keras QAT model's outputs within one
    output step with the same classes, in a default session and with optimizations off."""
    from tests.support.keras_blocks import INTEGER_OPS, TABLES

    for backend, run in ran.items():
        for block, expected_ops in INTEGER_OPS.items():
            where = f"{backend} {block}"
            assert run[f"{block}_unconverted"].tolist() == [""], (where, run[f"{block}_unconverted"])
            ops = run[f"{block}_ops"].tolist()
            assert {op: ops.count(op) for op in expected_ops} == expected_ops, (where, ops)
            assert int(run[f"{block}_tables"]) == TABLES.get(block, 0), where
            assert not {"Conv", "MatMul", "Gemm", "Relu", "Clip", "Max", "Min", "Sigmoid", "Mul", "Concat", "Div",
                        "HardSwish", "HardSigmoid", "AveragePool", "GlobalAveragePool", "ReduceMean",
                        "BatchNormalization"} & set(ops), (where, ops)
            keras_out = run[f"{block}_keras"]
            # logits within one output step; the residual block's softmax probabilities within 5e-3 (as on TensorFlow)
            tolerance = 5e-3 if block == "residual" else float(np.diff(np.unique(keras_out)).min()) + 1e-6
            for got in run[f"{block}_int8"]:  # a default session, then optimizations off
                assert np.abs(got - keras_out).max() <= tolerance, where
                assert (got.argmax(1) == keras_out.argmax(1)).all(), where
        assert run["mobilenet_quantized"].tolist() == sorted(["stem", "dw", "sep", "project", "fc"]), backend


@pytest.mark.parametrize("backend", ["numpy", "openvino"])
def test_a_backend_recal_does_not_run_on_is_refused_with_the_fix(monkeypatch, backend):
    monkeypatch.setattr(keras.backend, "backend", lambda: backend)
    with pytest.raises(RuntimeError, match=f"this process uses '{backend}': set KERAS_BACKEND to one of them"):
        ScheduledModifierManager.from_yaml(keras_backend_run.RECIPE).modify(_net(), keras.optimizers.SGD(),
                                                                             steps_per_epoch=4)


def test_what_jax_cannot_run_is_refused_located_in_the_recipe(monkeypatch):
    """Trainable flags cannot change mid-fit on JAX: one error naming the modifier, at modify (QAT runs there)."""
    recipe = """
    modifiers:
      - !EpochRangeModifier {start_epoch: 0.0, end_epoch: 2.0}
      - !TrainableParamsModifier {params: [d/kernel], trainable: false, start_epoch: 1.0, end_epoch: 2.0}
      - !QuantizationModifier {start_epoch: 1.0}
    """
    monkeypatch.setattr(keras.backend, "backend", lambda: "jax")
    with pytest.raises(RecipeError) as err:
        ScheduledModifierManager.from_yaml(recipe).modify(_net(), keras.optimizers.SGD(), steps_per_epoch=4)
    text = str(err.value)
    assert "!TrainableParamsModifier (modifiers[1])" in text and "cannot change mid-fit on Keras's JAX backend" in text
    assert "QuantizationModifier" not in text and "KERAS_BACKEND=tensorflow or torch" in text


def _net():
    inputs = keras.Input((4,))
    return keras.Model(inputs, keras.layers.Dense(2, name="d")(inputs))


@pytest.mark.parametrize("op", ["MaxPool", "AveragePool", "window sum"])
def test_a_channels_last_pool_over_six_axes_becomes_a_2d_pool(tmp_path, op):
    """jax2onnx's forms of a channels-last 2-D pool (rank 6, window [1, 2, 2, 1]): a MaxPool or AveragePool that
    onnxruntime cannot run, or Keras's average pool as a window sum (a Conv with an all-ones kernel, a Squeeze and a
    Div by the window's size) that no int8 pass reads as a pool, are rewritten to the 2-D pool they mean; the values
    are the pool of each 2x2 window per channel."""
    import onnx
    import onnxruntime
    from onnx import TensorProto, helper, numpy_helper

    from recal_keras.export import _pools_channels_first

    axes = numpy_helper.from_array(np.array([0, 1], np.int64), "axes")
    if op == "window sum":
        constants = [axes, numpy_helper.from_array(np.ones((1, 1, 1, 2, 2, 1), np.float32), "ones"),
                     numpy_helper.from_array(np.array(4.0, np.float32), "size")]
        nodes = [helper.make_node("Unsqueeze", ["x", "axes"], ["x6"]),
                 helper.make_node("Conv", ["x6", "ones"], ["s6"], name="sum", strides=[1, 2, 2, 1], group=1),
                 helper.make_node("Squeeze", ["s6", "axes"], ["s"]), helper.make_node("Div", ["s", "size"], ["y"])]
    else:
        constants = [axes]
        nodes = [helper.make_node("Unsqueeze", ["x", "axes"], ["x6"]),
                 helper.make_node(op, ["x6"], ["p6"], name="pool", kernel_shape=[1, 2, 2, 1], strides=[1, 2, 2, 1],
                                  ceil_mode=1),  # a pool's own attribute (no effect on these even sizes): kept
                 helper.make_node("Squeeze", ["p6", "axes"], ["y"])]
    graph = helper.make_graph(nodes, "pool", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 4, 6, 3])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 2, 3, 3])], constants)
    path = tmp_path / "pool.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    _pools_channels_first(str(path))
    onnx.checker.check_model(str(path))
    x = np.random.default_rng(0).standard_normal((2, 4, 6, 3)).astype(np.float32)
    windows = x.reshape(2, 2, 2, 3, 2, 3).transpose(0, 1, 3, 5, 2, 4).reshape(2, 2, 3, 3, 4)
    expected = windows.max(axis=-1) if op == "MaxPool" else windows.mean(axis=-1)
    levels = onnxruntime.GraphOptimizationLevel
    for level in (levels.ORT_DISABLE_ALL, levels.ORT_ENABLE_ALL):
        options = onnxruntime.SessionOptions()
        options.graph_optimization_level = level
        session = onnxruntime.InferenceSession(str(path), options)
        np.testing.assert_allclose(session.run(None, {"x": x})[0], expected, atol=1e-6)
    nodes = onnx.load(path).graph.node
    ops = [n.op_type for n in nodes]
    assert ops.count("MaxPool" if op == "MaxPool" else "AveragePool") == 1 and not {"Conv", "Div"} & set(ops)
    pool = next(n for n in nodes if n.op_type.endswith("Pool"))
    assert {a.name: helper.get_attribute_value(a) for a in pool.attribute}.get("ceil_mode") == \
        (None if op == "window sum" else 1)


def test_the_jax_qdq_primitive_exports_as_a_quantize_dequantize_pair(tmp_path):
    """recal's JAX QDQ primitive computes onnxruntime's QuantizeLinear / DequantizeLinear (per tensor, uint8; per
    channel, int8) and jax2onnx writes it as those two nodes, so a JAX QAT export holds the pairs the converter
    reads; without the plugin jax2onnx would refuse the primitive."""
    jax = pytest.importorskip("jax")
    pytest.importorskip("jax2onnx")
    import jax2onnx
    import onnx
    import onnxruntime

    from recal_keras.jax_qdq import qdq

    rng = np.random.default_rng(0)
    w = rng.standard_normal((4, 6)).astype(np.float32)
    w_scale = (np.abs(w).max(axis=0) / 127).astype(np.float32)

    def f(x):
        return qdq(x, np.float32(0.05), np.uint8(120)) @ qdq(w, w_scale, np.zeros(6, np.int8), axis=1)

    x = (rng.standard_normal((3, 4)) * 4).astype(np.float32)  # beyond the uint8 range too: clipped
    q = np.clip(np.round(x / 0.05) + 120, 0, 255)
    expected = ((q - 120) * 0.05).astype(np.float32) @ (np.round(w / w_scale) * w_scale)
    np.testing.assert_allclose(np.asarray(jax.jit(f)(x)), expected, rtol=1e-5, atol=1e-5)
    path = str(tmp_path / "qdq.onnx")
    jax2onnx.to_onnx(f, inputs=[jax.ShapeDtypeStruct(("n", 4), np.float32)], return_mode="file", output_path=path)
    ops = [n.op_type for n in onnx.load(path).graph.node]
    assert ops.count("QuantizeLinear") == 2 and ops.count("DequantizeLinear") == 2
    session = onnxruntime.InferenceSession(path)
    np.testing.assert_allclose(session.run(None, {session.get_inputs()[0].name: x})[0], expected, rtol=1e-5,
                               atol=1e-5)


_NEVER_CALLED = """
import warnings, keras, numpy as np, torch  # noqa: E402
from recal_keras import ScheduledModifierManager, export_onnx  # noqa: E402
model = keras.applications.MobileNetV2(input_shape=(32, 32, 3), alpha=0.35, weights=None, classes=10)
manager = ScheduledModifierManager.from_yaml("- !QuantizationModifier {start_epoch: 0.0}\\n")
qat, _ = manager.modify(model, keras.optimizers.SGD(0.01), steps_per_epoch=4)
with warnings.catch_warnings(record=True) as said:
    warnings.simplefilter("always")
    export_onnx(qat, "%s")
tracer = [w for w in said if issubclass(w.category, torch.jit.TracerWarning)]
print("tracer warnings", len(tracer), [str(w.message)[:80] for w in tracer[:2]])
"""


@pytest.mark.slow
def test_a_keras_application_never_called_exports_on_the_torch_backend_without_a_flood(tmp_path):
    """keras.applications' MobileNetV2, QAT-prepared and never called (no fit, no predict): on the PyTorch backend
    ``export_onnx`` calls it once on zeros (Keras's own export refuses a model never called) and writes it, and
    torch.jit's TracerWarnings about the qparams becoming constants (one per layer, by design) are not shown."""
    pytest.importorskip("torch")
    out = tmp_path / "never_called.onnx"
    env = {**os.environ, "KERAS_BACKEND": "torch", "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", _NEVER_CALLED % out], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "tracer warnings 0 " in done.stdout, done.stdout
    assert out.exists()


def test_the_keras_callbacks_run_under_jax_data_parallelism_as_on_one_device(tmp_path):
    """``keras.distribution.DataParallel`` on two (CPU) devices: the same masks, LR and weights as one device."""
    out = tmp_path / "dp.npz"
    env = {**os.environ, "KERAS_BACKEND": "jax"}
    subprocess.run([sys.executable, "-m", "tests.support.keras_data_parallel_run", str(out)], cwd=ROOT, env=env, check=True,
                   capture_output=True, timeout=600)
    run = np.load(out)
    assert int(run["parallel/devices"]) == 2 and int(run["single/devices"]) == 1
    assert float(run["parallel/lr"]) == float(run["single/lr"]) == pytest.approx(0.05 * 0.5 ** 2)
    kernels = [k.split("/", 1)[1] for k in run.files if k.startswith("single/") and k.endswith("kernel")]
    assert kernels
    for name in kernels:
        single, parallel = run[f"single/{name}"], run[f"parallel/{name}"]
        assert np.array_equal(single == 0, parallel == 0), name  # the same masks
        assert abs(float((single == 0).mean()) - 0.7) < 0.02
        np.testing.assert_allclose(parallel, single, atol=1e-6)


@pytest.mark.slow
def test_learned_scales_train_resume_and_convert_on_every_keras_backend(tmp_path):
    """``observer: lsq`` on the weights and the layers' inputs (W8A8), AdamW with weight decay: on every backend the
    scales train (excluded from the weight decay, as recal_torch's param group of them is), the finalized export
    converts to an int8 model with every layer integer, verified, that classifies every test digit as the Keras
    model does; a run resumed from the ``.keras`` file written during QAT ends on the uninterrupted run's weights,
    bit for bit (on JAX it did not before the loaded model's QAT step count became one of its variables: the step
    was a constant of the compiled train step, so the QAT switches read a stale step)."""
    pytest.importorskip("jax")
    pytest.importorskip("torch")
    from tests.support import keras_learned_run

    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    others = {b: subprocess.Popen([sys.executable, "-m", "tests.support.keras_learned_run", str(tmp_path / f"{b}.npz")],
                                  cwd=ROOT, env={**env, "KERAS_BACKEND": b}, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True) for b in ("jax", "torch")}
    keras_learned_run.run(str(tmp_path / "tensorflow.npz"))
    for backend, process in others.items():
        output, _ = process.communicate(timeout=600)
        assert process.returncode == 0, output[-3000:]
    for backend in ("tensorflow", "jax", "torch"):
        run = np.load(tmp_path / f"{backend}.npz")
        assert str(run["backend"]) == backend
        assert len(run["names"]) == 6 and (run["moved"] > 1e-3).all(), run["moved"]  # 4 kernels' and 2 inputs' scales
        assert sorted(run["excluded"]) == sorted(run["names"])  # no weight decay on the scales
        assert bool(run["verified"]) and float(run["agreement"]) == 1.0
        assert str(run["float_ops"]) in ("{}", "{'Add': 1}"), run["float_ops"]  # (tf2onnx: the logits' bias)
        assert float(run["resume_difference"]) == 0.0, (backend, str(run["worst"]))


def test_learned_scales_refusals_are_located():
    """What Keras and the TensorFlow graph API cannot learn is refused, located: a learning rate of the scales' own
    (their optimizers have one for every variable) and a calibrated start."""
    from recal_core.recipe import load_recipe
    from recal_keras.recipe_support import qat_problems

    base = ("- !QuantizationModifier {start_epoch: 0, scheme: {input_activations: {symmetric: false, observer: lsq, "
            "observer_kwargs: %s}, weights: {}}}\n")
    for kwargs in ("{lr_factor: 0.1}", "{calibration_steps: 4}"):
        manager = ScheduledModifierManager.from_yaml(base % kwargs)
        with pytest.raises(RecipeError, match=r"modifiers\[0\].*scheme.*one learning rate for every variable"):
            manager.modify(keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)]), keras.optimizers.SGD(), 2)
        problems = qat_problems(load_recipe(base % kwargs).bind(2), "in the TensorFlow graph API", learns=True)
        assert [p.field for p in problems] == ["scheme"] and "graph API" in problems[0].message
