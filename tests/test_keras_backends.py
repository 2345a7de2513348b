"""Keras 3 on its TensorFlow, JAX and PyTorch backends: one recipe, the same masks, LR and weight decay at every step;
what a backend cannot run is refused at ``modify``, located in the recipe."""

import os
import subprocess
import sys

import numpy as np
import pytest

keras = pytest.importorskip("keras")
pytest.importorskip("tensorflow")

from recal_core import RecipeError  # noqa: E402
from recal_tf.keras import ScheduledModifierManager  # noqa: E402

from . import keras_backend_run  # noqa: E402
from .conftest import ROOT  # noqa: E402


def _run_on(backend: str, out, onnx_path) -> subprocess.Popen:
    """The recipe run on ``backend`` in a fresh interpreter (a process's Keras backend is fixed at import)."""
    env = {**os.environ, "KERAS_BACKEND": backend, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, "-m", "tests.keras_backend_run", str(out), str(onnx_path)], cwd=ROOT,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@pytest.mark.slow
def test_the_same_recipe_prunes_the_same_weights_at_every_step_on_every_keras_backend(tmp_path):
    """Unstructured, 2:4 and block pruning (one released mid-run), an exponential LR and a weight decay from epoch 1:
    after every step JAX and PyTorch hold exactly TensorFlow's zeros and ran at its LR and decay, and neither
    imported TensorFlow for recal; each backend's ONNX export (tf2onnx, jax2onnx, torch.onnx) computes what its
    Keras model does and holds the pruned zeros; a run resumed from the ``.keras`` file of epoch 2 with a new manager
    ends on the same weights, bit for bit."""
    pytest.importorskip("jax")
    pytest.importorskip("torch")
    others = {b: _run_on(b, tmp_path / f"{b}.npz", tmp_path / f"{b}.onnx") for b in ("jax", "torch")}
    keras_backend_run.run(str(tmp_path / "tensorflow.npz"), str(tmp_path / "tensorflow.onnx"), resume=False)
    for backend, process in others.items():
        output, _ = process.communicate(timeout=300)
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
    assert tf_run["onnx_error"] < 1e-5  # TensorFlow's resume from .keras: tests/test_keras.py
    assert tf_run["onnx_zeros"] >= sum(z[-1] for z in zeros.values())


@pytest.mark.parametrize("backend", ["numpy", "openvino"])
def test_a_backend_recal_does_not_run_on_is_refused_with_the_fix(monkeypatch, backend):
    monkeypatch.setattr(keras.backend, "backend", lambda: backend)
    with pytest.raises(RuntimeError, match=f"this process uses '{backend}': set KERAS_BACKEND to one of them"):
        ScheduledModifierManager.from_yaml(keras_backend_run.RECIPE).modify(_net(), keras.optimizers.SGD(),
                                                                             steps_per_epoch=4)


def test_what_jax_cannot_run_is_refused_located_in_the_recipe(monkeypatch):
    """QAT (TensorFlow only) and trainable flags (JAX) are one error naming each modifier, at modify."""
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
    assert text.startswith("2 problems")
    assert "!TrainableParamsModifier (modifiers[1])" in text and "cannot change mid-fit on Keras's JAX backend" in text
    assert "!QuantizationModifier (modifiers[2])" in text and "runs on the TensorFlow backend only" in text
    assert "KERAS_BACKEND=tensorflow" in text


def _net():
    inputs = keras.Input((4,))
    return keras.Model(inputs, keras.layers.Dense(2, name="d")(inputs))


@pytest.mark.parametrize("op", ["MaxPool", "AveragePool"])
def test_a_channels_last_pool_over_six_axes_becomes_a_2d_pool(tmp_path, op):
    """jax2onnx's form of a channels-last 2-D pool (rank 6, kernel [1, 2, 2, 1]), which onnxruntime cannot run, is
    rewritten to the 2-D pool it means; the values are the pool of each 2x2 window per channel."""
    import onnx
    import onnxruntime
    from onnx import TensorProto, helper, numpy_helper

    from recal_tf.keras.export import _pools_channels_first

    axes = numpy_helper.from_array(np.array([0, 1], np.int64), "axes")
    graph = helper.make_graph(
        [helper.make_node("Unsqueeze", ["x", "axes"], ["x6"]),
         helper.make_node(op, ["x6"], ["p6"], name="pool", kernel_shape=[1, 2, 2, 1], strides=[1, 2, 2, 1]),
         helper.make_node("Squeeze", ["p6", "axes"], ["y"])],
        "pool", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 4, 6, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], [axes])
    path = tmp_path / "pool.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    _pools_channels_first(str(path))
    x = np.random.default_rng(0).standard_normal((2, 4, 6, 3)).astype(np.float32)
    windows = x.reshape(2, 2, 2, 3, 2, 3).transpose(0, 1, 3, 5, 2, 4).reshape(2, 2, 3, 3, 4)
    expected = windows.max(axis=-1) if op == "MaxPool" else windows.mean(axis=-1)
    levels = onnxruntime.GraphOptimizationLevel
    for level in (levels.ORT_DISABLE_ALL, levels.ORT_ENABLE_ALL):
        options = onnxruntime.SessionOptions()
        options.graph_optimization_level = level
        session = onnxruntime.InferenceSession(str(path), options)
        np.testing.assert_allclose(session.run(None, {"x": x})[0], expected, atol=1e-6)
    assert [n.op_type for n in onnx.load(path).graph.node].count(op) == 1
