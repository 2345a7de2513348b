"""onnxruntime's own quantizers' exports (quantize_static of a small CNN and a BERT, its extra options, 16-bit tensors,
int4 weights, blocked MatMulNBits weights), as the tool writes them."""

import collections
import warnings

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto

from recal_onnx import ModelError, UnconvertedOpsWarning, quantize_qat_export
from tests.onnx.interop_graphs import _export_small_net, _optimized_ops, _quantize_static, _tiny_bert
from tests.support.onnx_graphs import ops, reference, run


@pytest.mark.parametrize("activation, per_channel", [("QUInt8", True), ("QUInt8", False), ("QInt8", True)])
def test_quantize_static_exports_convert_with_every_layer_integer(activation, per_channel, tmp_path):
    """onnxruntime's quantize_static (QDQ) of a small CNN exported by torch.onnx with its fixed batch of 1: int32
    biases, the residual add, every conv and the classifier integer; verified on 256 samples, op by op within a
    step of the QDQ file run as written."""
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static

    _export_small_net(tmp_path / "fp32.onnx")
    rng = np.random.default_rng(0)

    class Reader(CalibrationDataReader):
        def __init__(self):
            self.items = iter([{"input": rng.standard_normal((1, 3, 8, 8)).astype(np.float32)} for _ in range(8)])

        def get_next(self):
            return next(self.items, None)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        quantize_static(str(tmp_path / "fp32.onnx"), str(tmp_path / "qdq.onnx"), Reader(), quant_format=QuantFormat.QDQ,
                        activation_type=getattr(QuantType, activation), weight_type=QuantType.QInt8,
                        per_channel=per_channel)
    written = collections.Counter(ops(onnx.load(tmp_path / "qdq.onnx")))
    assert written["DequantizeLinear"] > written["QuantizeLinear"]  # int32 biases among them
    result = quantize_qat_export(tmp_path / "qdq.onnx", tmp_path / "int8.onnx")
    kinds = collections.Counter(ops(result.model))
    assert not {"Conv", "Gemm", "MatMul"} & set(kinds) and kinds["QLinearConv"] == 2 and kinds["QGemm"] == 1, kinds
    assert not result.float_nodes, result.float_reasons
    v = result.verification
    assert v.samples >= 256 and v.local_steps <= 1 and v.local_tensors >= 3, v
    if activation == "QUInt8":  # what onnxruntime's own fusion runs integer: the same kernels, not merely as many
        assert _optimized_ops(tmp_path / "qdq.onnx", tmp_path) == _optimized_ops(tmp_path / "int8.onnx", tmp_path)


@pytest.mark.parametrize("options", [{"DedicatedQDQPair": True}, {"ActivationSymmetric": True},
                                     {"AddQDQPairToWeight": True}, {"QDQKeepRemovableActivations": True},
                                     {"QuantizeBias": False}, {"UseQDQContribOps": True}], ids=lambda o: next(iter(o)))
def test_quantize_statics_extra_options_convert_with_every_layer_integer(options, tmp_path):
    """The ``extra_options`` of quantize_static users set change the QDQ form, not what converts: a Q/DQ pair per
    reader (``DedicatedQDQPair``: the residual add read two twin quantizers and stayed float), uint8 activations
    symmetric about 128, float weights behind a Q/DQ pair, ReLUs kept between their Q/DQs, float biases,
    onnxruntime's own Q/DQ domain. Every op integer, op by op within a step."""
    _export_small_net(tmp_path / "fp32.onnx")
    feeds = [{"input": np.random.default_rng(i).standard_normal((1, 3, 8, 8)).astype(np.float32)} for i in range(8)]
    _quantize_static(tmp_path / "fp32.onnx", tmp_path / "qdq.onnx", feeds, extra_options=options)
    result = quantize_qat_export(tmp_path / "qdq.onnx", tmp_path / "int8.onnx")
    kinds = collections.Counter(ops(result.model))
    assert kinds["QLinearConv"] == 2 and kinds["QGemm"] == 1 and kinds["QLinearAdd"] == 1, kinds
    assert not result.float_nodes, result.float_reasons
    assert result.verification.local_steps <= 1, result.verification


@pytest.mark.parametrize("wide, contrib", [("QUInt16", False), ("QInt16", True)])
def test_a_16_bit_tensor_among_8_bit_ones_leaves_only_its_layers_float(wide, contrib, tmp_path):
    """Mixed precision as quantize_static writes it (``TensorQuantOverrides``: one sensitive tensor on 16 bits, in the
    default domain at opset 21 or onnxruntime's own): the conv that writes it and the layers that read it stay float,
    each saying it is the 16-bit tensor; every other layer is integer, and the model verifies op by op."""
    from onnxruntime.quantization import QuantType

    _export_small_net(tmp_path / "fp32.onnx")
    first_relu = next(n.output[0] for n in onnx.load(tmp_path / "fp32.onnx").graph.node if n.op_type == "Relu")
    feeds = [{"input": np.random.default_rng(i).standard_normal((1, 3, 8, 8)).astype(np.float32)} for i in range(8)]
    overrides = {first_relu: [{"quant_type": getattr(QuantType, wide)}]}
    _quantize_static(tmp_path / "fp32.onnx", tmp_path / "qdq.onnx", feeds,
                     extra_options={"TensorQuantOverrides": overrides, "UseQDQContribOps": contrib})
    written = {t.data_type for t in onnx.load(tmp_path / "qdq.onnx").graph.initializer}
    assert {onnx.TensorProto.INT16, onnx.TensorProto.UINT16} & written, written  # it is there
    with pytest.warns(UnconvertedOpsWarning, match=r"(?s)3 nodes \(Conv x2, Add x1\).*16 bits"):
        result = quantize_qat_export(tmp_path / "qdq.onnx", tmp_path / "int8.onnx")
    kinds = collections.Counter(ops(result.model))
    assert kinds["QLinearConv"] == 0 and kinds["Conv"] == 2 and kinds["QGemm"] == 1, kinds  # conv2 reads it too
    reasons = result.float_reasons
    assert any("output is quantized to 16 bits" in why for why in reasons.values()), reasons
    assert sum("is 16 bits" in why for why in reasons.values()) >= 2, reasons
    assert result.verification.local_steps <= 1 and result.verification.samples >= 256, result.verification
    with pytest.warns(UnconvertedOpsWarning, match="16 bits"):  # in QDQ form: onnxruntime fuses no kernel there
        qdq = quantize_qat_export(tmp_path / "qdq.onnx", tmp_path / "int8.qdq.onnx", format="qdq")
    assert set(qdq.float_reasons) == set(reasons) and qdq.float_ops.get("Conv") == 2, (qdq.float_reasons, qdq.float_ops)


def test_an_integer_qoperator_model_that_fails_is_said_to_be_one(tmp_path):
    """quantize_static's QOperator format with int8 activations runs with onnxruntime's optimizations off but not in
    a default session (no int8 x int8 QLinearConv kernel there): the converter, which passes such a model through,
    says what the model is and which form it takes, not only onnxruntime's words."""
    from onnxruntime.quantization import QuantFormat, QuantType

    _export_small_net(tmp_path / "fp32.onnx")
    feeds = [{"input": np.random.default_rng(i).standard_normal((1, 3, 8, 8)).astype(np.float32)} for i in range(4)]
    _quantize_static(tmp_path / "fp32.onnx", tmp_path / "qoperator.onnx", feeds, quant_format=QuantFormat.QOperator,
                     activation_type=QuantType.QInt8, weight_type=QuantType.QInt8)
    with pytest.raises(ModelError, match=r"already an integer \(QOperator\) model \(QLinearConv x2.*QuantFormat.QDQ"):
        quantize_qat_export(tmp_path / "qoperator.onnx", tmp_path / "int8.onnx")
    assert not (tmp_path / "int8.onnx").exists()


def test_quantize_statics_int4_weights_convert_as_the_int8_they_hold(tmp_path):
    """``quantize_static(weight_type=QInt4)`` writes onnxruntime's own (com.microsoft) Q/DQ with int4 weights per
    channel: each weight is widened to int8 (the same integers, within +-8: exact on every CPU), so every conv and
    the classifier is integer, verified op by op."""
    from onnxruntime.quantization import QuantType

    _export_small_net(tmp_path / "fp32.onnx")
    rng = np.random.default_rng(0)
    _quantize_static(tmp_path / "fp32.onnx", tmp_path / "qdq.onnx",
                     [{"input": rng.standard_normal((1, 3, 8, 8)).astype(np.float32)} for _ in range(8)],
                     weight_type=QuantType.QInt4, per_channel=True)
    written = onnx.load(tmp_path / "qdq.onnx")
    assert any(t.data_type == TensorProto.INT4 for t in written.graph.initializer)
    result = quantize_qat_export(tmp_path / "qdq.onnx", tmp_path / "int8.onnx")
    kinds = collections.Counter(ops(result.model))
    assert kinds["QLinearConv"] == 2 and kinds["QGemm"] == 1 and not result.float_nodes, (kinds, result.float_reasons)
    assert result.avx2_path is None  # weights within +-8: one file, exact everywhere
    assert result.verification.samples >= 256 and result.verification.local_steps <= 1


@pytest.mark.parametrize("activation, fmt", [("QUInt8", "qoperator"), ("QInt8", "qoperator"), ("QUInt8", "qdq")])
def test_quantize_statics_bert_converts_with_its_softmax_exact(activation, fmt, tmp_path):
    """quantize_static's BERT quantizes the attention probabilities on 1/255, a grid onnxruntime's own fused
    QLinearSoftmax misses (it multiplies by floor(1 / scale) = 254): the conversion writes QLinearSoftmax on 255 and
    is verified op by op against the file as written (it was refused before: 0.19% of the values a step off). The
    bias Adds and the attention's scale (a quantized constant beside an activation) become QLinearAdd / QLinearMul:
    only LayerNorm and GELU stay float (the pooler's Gather of the first token moves integers). A ``qdq`` file keeps
    the softmax float, its input dequantized apart so onnxruntime does not fuse it onto 1/254, with that reason."""
    from onnxruntime.quantization import QuantType

    fp32 = _tiny_bert(tmp_path)
    rng = np.random.default_rng(0)
    _quantize_static(fp32, tmp_path / "qdq.onnx",
                     [{"input_ids": rng.integers(0, 200, (1, 16)).astype(np.int64)} for _ in range(8)],
                     activation_type=getattr(QuantType, activation), weight_type=QuantType.QInt8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UnconvertedOpsWarning)
        result = quantize_qat_export(tmp_path / "qdq.onnx", tmp_path / "int8.onnx", format=fmt)
    kinds = collections.Counter(ops(result.model))
    if fmt == "qdq":
        softmax = [reason for name, reason in result.float_reasons.items() if "Softmax" in name]
        assert len(softmax) == 2 and all("floors to 254" in reason for reason in softmax), result.float_reasons
        assert "QLinearSoftmax" not in kinds and kinds["Cast"] >= 2, kinds
    else:
        assert kinds["QLinearSoftmax"] == 2 and not {"MatMul", "Gemm", "Softmax"} & set(kinds), kinds
        assert {op for op, _ in result.float_nodes} <= {"LayerNormalization", "Gelu"}, result.float_reasons
    v = result.verification
    assert v.samples >= 256 and v.local_steps <= 1 and v.local_share <= 1e-3, v


@pytest.mark.parametrize("symmetric", [True, False])
def test_onnxruntimes_blocked_int4_weights_become_matmulnbits_exactly(symmetric, tmp_path):
    """onnxruntime's ``MatMulNBitsQuantizer`` in QDQ form writes opset-21 ``DequantizeLinear(int4 | uint4,
    block_size=32)`` before each MatMul: each becomes ``MatMulNBits`` in 4 bits (an asymmetric weight with a zero
    point a block), the float output the same to the last bit."""
    from onnxruntime.quantization import QuantFormat
    from onnxruntime.quantization.matmul_nbits_quantizer import DefaultWeightOnlyQuantConfig, MatMulNBitsQuantizer

    class MLP(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(128, 96), torch.nn.Linear(96, 64)

        def forward(self, x):
            return self.b(torch.relu(self.a(x)))

    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(MLP().eval(), (torch.randn(1, 8, 128),), tmp_path / "fp32.onnx", dynamo=False,
                          opset_version=21, input_names=["x"], dynamic_axes={"x": {0: "batch"}})
    config = DefaultWeightOnlyQuantConfig(block_size=32, is_symmetric=symmetric, quant_format=QuantFormat.QDQ)
    quantizer = MatMulNBitsQuantizer(onnx.load(tmp_path / "fp32.onnx"), algo_config=config)
    quantizer.process()
    quantizer.model.save_model_to_file(str(tmp_path / "qdq.onnx"))
    blocked = [n for n in onnx.load(tmp_path / "qdq.onnx").graph.node if n.op_type == "DequantizeLinear"]
    assert len(blocked) == 2 and all(a.name != "block_size" or a.i == 32 for n in blocked for a in n.attribute)
    result = quantize_qat_export(tmp_path / "qdq.onnx")
    nbits = [n for n in result.model.graph.node if n.op_type == "MatMulNBits"]
    assert len(nbits) == 2 and all(a.i == 4 for n in nbits for a in n.attribute if a.name == "bits")
    assert (len(nbits[0].input) > 3 and nbits[0].input[3] != "") == (not symmetric)  # zero points, a block each
    feeds = {"x": np.random.default_rng(1).standard_normal((4, 8, 128)).astype(np.float32)}
    np.testing.assert_array_equal(run(result.model, feeds)[0], reference(onnx.load(tmp_path / "qdq.onnx"), feeds)[0])
    if symmetric:  # the CLI's --accuracy-level: onnxruntime's int8-input kernels, verified as an inexact model is
        from recal_app.cli import main

        assert main(["quantize-qat-export", str(tmp_path / "qdq.onnx"), str(tmp_path / "fast.onnx"),
                     "--accuracy-level", "4"]) == 0
        levels = [a.i for n in onnx.load(tmp_path / "fast.onnx").graph.node if n.op_type == "MatMulNBits"
                  for a in n.attribute if a.name == "accuracy_level"]
        assert levels == [4, 4]
