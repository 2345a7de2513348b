"""keras.applications' blocks (depthwise and separable convs, swish and squeeze-excitation, hard-swish, DenseNet's
concatenations, residual adds) QAT-trained and run on the integers."""

import numpy as np
import pytest
tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")
from recal_keras import export_onnx  # noqa: E402
from tests.support.keras_blocks import (QAT, SPE, densenet_block, efficientnet_block, mobilenet_block, mobilenet_v3_block,  # noqa: E402
                           residual_net)
from tests.keras.keras_models import _assert_int8_within_a_step, _block_to_int8, _modified  # noqa: E402


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
