"""The QDQ forms other tools write, each on a tiny graph: int32 biases (``DequantizeLinear(int32, s_x * s_w)``), weights
with a zero point (uint8, recal's own ``format="qdq"`` output), a fixed batch verified on the promised sample count,
a QAT model that is itself not finite, every float node's reason; and onnxruntime's ``quantize_static`` exports of a
small CNN, as the tool writes them."""

import collections
import warnings
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper

from recal_onnx import ModelError, UnconvertedOpsWarning, quantize_qat_export
from recal_onnx.verify import generated_inputs

from tests.support.onnx_graphs import QONNX_DOMAIN, Builder, aimet_layer, ops, qonnx_model, qonnx_quant, reference, run

X_SCALE, OUT_SCALE = 0.03, 0.02


def _int32_bias(b, w_scale, n, per_channel, grid=1.0, dtype=np.int32):
    """``DequantizeLinear(int32, s_x * s_w * grid)``: a bias as quantize_static, Brevitas and AIMET write it
    (``dtype`` int8: as AMD Quark's XINT8 does, on a coarser power-of-two grid)."""
    scale = (np.float32(X_SCALE) * np.asarray(w_scale, np.float32) * np.float32(grid)).astype(np.float32)
    q = b.rng.integers(-3000, 3000, n).astype(np.int32) if dtype == np.int32 else b.rng.integers(-100, 100, n, dtype)
    return b.node("DequantizeLinear", [b.const(q, "bq"), b.const(scale if per_channel else scale.reshape(-1)[0], "bs")],
                  **({"axis": 0} if per_channel else {}))


def _weight_scale(b, w):
    producer = next(n for n in b.nodes if n.output[0] == w)
    return onnx.numpy_helper.to_array(next(t for t in b.inits if t.name == producer.input[1]))


def _layer(op, per_channel, grid=1.0, batch=2, bias_dtype=np.int32):
    b = Builder()
    if op == "Conv":
        x = b.qdq("x", X_SCALE, 128)
        w = b.weight((4, 3, 3, 3), per_channel=per_channel)
        y = b.node("Conv", [x, w, _int32_bias(b, _weight_scale(b, w), 4, per_channel, grid, bias_dtype)],
                   pads=[1, 1, 1, 1])
        shape = [batch, 3, 6, 6]
    else:
        x = b.qdq("x", X_SCALE, 128)
        w = b.weight((8, 4), axis=1, per_channel=per_channel)
        bias = _int32_bias(b, _weight_scale(b, w), 4, per_channel, grid, bias_dtype)
        y = b.node("Gemm", [x, w, bias]) if op == "Gemm" else b.node("Add", [b.node("MatMul", [x, w]), bias])
        shape = [batch, 8]
    model = b.model([("x", shape)], [b.qdq(y, OUT_SCALE, 128)])
    out = model.graph.output[0].type.tensor_type.shape  # as exporters declare it (onnxruntime's contrib QGemm has
    out.dim.extend(onnx.TensorShapeProto.Dimension(dim_value=d) for d in shape[:1] + [4])  # no shape inference)
    if op == "Conv":
        out.dim.extend(onnx.TensorShapeProto.Dimension(dim_value=d) for d in (6, 6))
    return model, shape


@pytest.mark.parametrize("op", ["Conv", "Gemm", "MatMul"])
@pytest.mark.parametrize("per_channel", [True, False], ids=["per-channel", "per-tensor"])
def test_an_int32_bias_on_the_grid_converts_exactly(op, per_channel):
    model, shape = _layer(op, per_channel)
    feeds = {"x": np.random.default_rng(1).standard_normal(shape).astype(np.float32)}
    result = quantize_qat_export(model, inputs=feeds)
    assert op not in ops(result.model) and not result.float_nodes, ops(result.model)
    assert not result.rounded_biases  # s_b is s_x * s_w: the int32 values as written
    np.testing.assert_array_equal(run(result.model, feeds)[0], reference(model, feeds)[0])


@pytest.mark.parametrize("op", ["Conv", "Gemm"])
def test_an_int8_bias_on_a_coarser_grid_converts_exactly(op):
    """AMD Quark's XINT8 quantizes a bias as it does a weight: int8, on a power-of-two grid coarser than s_x * s_w
    (here 4x). Read as the float it means, it lies on the int32 grid the integer layer holds: exact."""
    model, shape = _layer(op, per_channel=False, grid=4.0, bias_dtype=np.int8)
    feeds = {"x": np.random.default_rng(1).standard_normal(shape).astype(np.float32)}
    result = quantize_qat_export(model, inputs=feeds)
    assert op not in ops(result.model) and not result.float_nodes and not result.rounded_biases, ops(result.model)
    np.testing.assert_array_equal(run(result.model, feeds)[0], reference(model, feeds)[0])


def test_a_bias_shared_with_an_add_and_quantized_as_its_operand_is_read_as_the_bias():
    """torch.onnx shares equal biases (wav2vec2's positional conv and its attention projections' zeros) and
    quantize_static then quantizes the one constant as an Add's uint8 operand: the conv reads it as the float bias it
    means (integer, exact), the Add still reads its dequantized operand."""
    b = Builder()
    x = b.qdq("x", X_SCALE, 128)
    shared = b.node("DequantizeLinear", [b.const(np.array([0, 3, 0, 7], np.uint8), "bq"), b.const(np.float32(0.01)),
                                         b.const(np.uint8(0))])
    conv = b.node("Conv", [x, b.weight((4, 3, 3, 3)), shared], pads=[1, 1, 1, 1])
    pooled = b.qdq(b.node("Flatten", [b.node("GlobalAveragePool", [b.qdq(conv, OUT_SCALE, 128)])]), OUT_SCALE, 128)
    added = b.node("Add", [b.node("MatMul", [pooled, b.weight((4, 4), axis=1)]), shared])  # a projection's bias
    model = b.model([("x", [2, 3, 6, 6])], [b.qdq(added, OUT_SCALE, 128)])
    feeds = {"x": np.random.default_rng(1).standard_normal((2, 3, 6, 6)).astype(np.float32)}
    result = quantize_qat_export(model, inputs=feeds)
    assert "QLinearConv" in ops(result.model) and "Conv" not in ops(result.model), result.float_reasons
    np.testing.assert_array_equal(run(result.model, feeds)[0], reference(model, feeds)[0])


def test_a_batchnorm_whose_parameters_quantize_static_quantized_becomes_integer():
    """quantize_static quantizes a BatchNorm no conv took in as a layer: its scale an int8 weight, its bias int32. Read
    as the floats they mean, the BatchNorm becomes an integer depthwise conv; on a [N, C] tensor (LeViT's
    BatchNorm1d after a Linear) it stays float, saying why."""
    for rank in (4, 2):
        b = Builder()
        shape = [2, 4, 3, 3] if rank == 4 else [6, 4]
        x = b.qdq("x", X_SCALE, 128)
        gamma = b.node("DequantizeLinear", [b.const(np.array([90, -40, 127, 64], np.int8)), b.const(np.float32(0.01)),
                                            b.const(np.int8(0))])
        beta = b.node("DequantizeLinear", [b.const(np.array([500, -70, 0, 1200], np.int32)), b.const(np.float32(1e-3)),
                                           b.const(np.int32(0))])
        y = b.node("BatchNormalization", [x, gamma, beta, b.const(np.linspace(-0.2, 0.3, 4, dtype=np.float32)),
                                          b.const(np.linspace(0.5, 2, 4, dtype=np.float32))])
        model = b.model([("x", shape)], [b.qdq(y, OUT_SCALE, 128)])
        feeds = {"x": np.random.default_rng(1).standard_normal(shape).astype(np.float32)}
        if rank == 4:
            result = quantize_qat_export(model, inputs=feeds)
            assert "QLinearConv" in ops(result.model) and "BatchNormalization" not in ops(result.model)
            assert result.verification.local_steps <= 1, result.verification
        else:
            with pytest.warns(UnconvertedOpsWarning, match=r"normalizes a \[N, C\] tensor"):
                result = quantize_qat_export(model, inputs=feeds)
            np.testing.assert_array_equal(run(result.model, feeds)[0], reference(model, feeds)[0])


def test_an_int32_bias_on_another_grid_is_rounded_and_said():
    model, shape = _layer("Conv", True, grid=0.5)
    feeds = {"x": np.random.default_rng(1).standard_normal(shape).astype(np.float32)}
    result = quantize_qat_export(model, inputs=feeds)
    assert "QLinearConv" in ops(result.model) and result.rounded_biases
    assert "rounded" in result.rounded_biases_note
    assert np.abs(run(result.model, feeds)[0] - reference(model, feeds)[0]).max() <= OUT_SCALE + 1e-6


def _uint8_weight_conv(zero_point, low, high):
    b = Builder()
    x = b.qdq("x", X_SCALE, 128)
    q = b.rng.integers(low, high + 1, (4, 3, 3, 3)).astype(np.uint8)
    w = b.node("DequantizeLinear", [b.const(q, "w"), b.const(np.float32(0.01), "ws"),
                                    b.const(np.uint8(zero_point), "wz")])
    return b.model([("x", [2, 3, 6, 6])], [b.qdq(b.node("Conv", [x, w], pads=[1, 1, 1, 1]), OUT_SCALE, 128)])


@pytest.mark.parametrize("zero_point, low, high", [(128, 1, 255), (100, 0, 227)], ids=["zp128", "zp100"])
def test_uint8_weights_with_a_zero_point_become_int8(zero_point, low, high):
    model = _uint8_weight_conv(zero_point, low, high)
    feeds = {"x": np.random.default_rng(1).standard_normal((2, 3, 6, 6)).astype(np.float32)}
    result = quantize_qat_export(model, inputs=feeds)
    assert "QLinearConv" in ops(result.model) and not result.float_nodes
    np.testing.assert_array_equal(run(result.model, feeds)[0], reference(model, feeds)[0])


def test_an_asymmetric_weight_whose_values_leave_int8_keeps_its_zero_point():
    """A uint8 weight with zero point 10 (255 - 10 leaves int8: quantize_static's WeightSymmetric=False) becomes int8
    with zero point -118, which QLinearConv subtracts itself: the same numbers, where it once stayed float."""
    model = _uint8_weight_conv(10, 0, 255)
    feeds = {"x": np.random.default_rng(1).standard_normal((2, 3, 6, 6)).astype(np.float32)}
    result = quantize_qat_export(model, inputs=feeds)
    assert "QLinearConv" in ops(result.model) and not result.float_nodes
    np.testing.assert_array_equal(run(result.model, feeds)[0], reference(model, feeds)[0])


def test_a_weight_with_a_zero_point_a_channel_whose_values_leave_int8_stays_float_and_says_why():
    b = Builder()
    q = b.rng.integers(0, 256, (4, 3, 3, 3)).astype(np.uint8)
    w = b.node("DequantizeLinear", [b.const(q, "w"), b.const(np.full(4, 0.01, np.float32), "ws"),
                                    b.const(np.array([10, 20, 30, 40], np.uint8), "wz")], axis=0)
    model = b.model([("x", [2, 3, 6, 6])], [b.qdq(b.node("Conv", [b.qdq("x", X_SCALE, 128), w], pads=[1, 1, 1, 1]),
                                                   OUT_SCALE, 128)])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", UnconvertedOpsWarning)
        result = quantize_qat_export(model)
    (op, name), = result.float_nodes
    assert op == "Conv" and "zero point 10..40" in result.float_reasons[name]
    assert "one zero point for the whole weight" in str(caught[0].message)


def test_recals_own_qdq_output_converts_again(tmp_path):
    model, shape = _layer("Conv", True)
    feeds = {"x": np.random.default_rng(1).standard_normal(shape).astype(np.float32)}
    qdq = quantize_qat_export(model, tmp_path / "qdq.onnx", format="qdq", weight_type="uint8", inputs=feeds)
    assert any(t.data_type == TensorProto.UINT8 for t in qdq.model.graph.initializer)
    again = quantize_qat_export(tmp_path / "qdq.onnx", inputs=feeds)
    assert "QLinearConv" in ops(again.model) and not again.float_nodes


def test_a_fixed_batch_is_verified_on_the_promised_sample_count():
    model, _ = _layer("Conv", True, batch=1)
    result = quantize_qat_export(model)
    assert result.verification.samples == 256 and result.verification.local_tensors >= 1


def test_a_fixed_batch_whose_tensors_drop_the_batch_axis_is_compared_op_by_op_a_batch_at_a_time():
    """torch.onnx's fixed batch of 1 with a layer run on ``[tokens, hidden]`` (BERT's MatMuls after a Reshape): the
    op-by-op check runs one batch at a time, each with that batch's QAT integers (it once fed 16 batches' worth
    of such a tensor to one run, and onnxruntime refused the input)."""
    b = Builder()
    x = b.node("Reshape", [b.qdq("x", X_SCALE, 128), b.const(np.array([6, 8], np.int64))])
    y = b.qdq(b.node("MatMul", [x, b.weight((8, 4), axis=1)]), OUT_SCALE, 128)
    model = b.model([("x", [1, 6, 8])], [b.node("Reshape", [y, b.const(np.array([1, 6, 4], np.int64))])])
    result = quantize_qat_export(model)
    v = result.verification
    assert v.samples == 256 and v.local_tensors >= 2 and v.local_steps <= 1, v


def test_a_qat_model_that_is_not_finite_is_refused_naming_its_constants():
    model, _ = _layer("Gemm", True)
    scale = next(t for t in model.graph.initializer if t.name.startswith("ws"))
    scale.CopyFrom(onnx.numpy_helper.from_array(np.full(onnx.numpy_helper.to_array(scale).shape, np.nan, np.float32),
                                                scale.name))
    with pytest.raises(ModelError, match=f"scale that is NaN or infinite \\(initializer '{scale.name}'\\)"):
        quantize_qat_export(model)
    b = Builder()  # an activation calibrated over -inf (quantize_static on a causal mask): the node to exclude named
    masked = b.node("Add", [b.qdq("x", X_SCALE, 128), b.qdq("mask", np.inf, 0)])
    model = b.model([("x", [2, 8]), ("mask", [2, 8])], [b.qdq(masked, 0.1, 128)])
    add = next(n.name for n in model.graph.node if n.op_type == "Add")
    with pytest.raises(ModelError, match=r"mean nothing.*-inf.*nodes_to_exclude=\['" + add + r"'\]"):
        quantize_qat_export(model)
    b = Builder()  # a NaN float bias: every output of the QAT model is NaN, compared with nothing
    y = b.node("Gemm", [b.qdq("x", X_SCALE, 128), b.weight((8, 4), axis=1), b.const(np.full(4, np.nan, np.float32),
                                                                                     "bias")])
    model = b.model([("x", [2, 8])], [y])
    with pytest.raises(ModelError, match="NaN or infinite on every verification input.*non-finite initializers: 'bias"), \
            pytest.warns(UnconvertedOpsWarning, match="its bias holds NaN or inf"):
        quantize_qat_export(model)


def test_every_float_node_has_a_reason_and_unnamed_ones_a_position():
    b = Builder()
    x = b.qdq("x", X_SCALE, 128)
    y = b.node("Cast", [b.node("Div", [x, b.qdq("x2", X_SCALE, 0)])], to=TensorProto.FLOAT)  # a float Div, a no-op Cast
    model = b.model([("x", [2, 8]), ("x2", [2, 8])], [b.qdq(y, 0.1, 128)])
    for node in model.graph.node:
        node.name = ""
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always", UnconvertedOpsWarning)
        result = quantize_qat_export(model)
    (op, name), = result.float_nodes  # the Cast computes nothing: not listed
    assert op == "Div" and name.startswith("Div #")
    assert "no integer kernel for Div" in result.float_reasons[name]


def test_a_quantized_constant_joins_a_concat_and_a_node_that_cannot_read_one_says_so():
    """ViT's class token under quantize_static (expanded over the batch, then quantized: a constant once folded)
    joins the patches in a QLinearConcat; a Sub of a quantized constant vector stays float, its reason saying the input
    is a dequantized constant (it once read "float, made by DequantizeLinear, not a DequantizeLinear of an integer
    tensor")."""
    b = Builder()
    token = b.node("Expand", [b.const(np.linspace(-1, 1, 8, dtype=np.float32).reshape(1, 1, 8)),
                              b.const(np.array([2, 1, 8], np.int64))])
    joined = b.node("Concat", [b.qdq(token, 0.02, 128), b.qdq("x", X_SCALE, 128)], axis=1)
    shifted = b.node("Sub", [b.qdq(joined, 0.05, 128), b.qdq(b.const(np.linspace(0, 1, 8, dtype=np.float32)), 0.01, 0)])
    model = b.model([("x", [2, 3, 8])], [b.qdq(shifted, 0.05, 128)])
    with pytest.warns(UnconvertedOpsWarning, match="dequantized constant"):
        result = quantize_qat_export(model)
    assert "QLinearConcat" in ops(result.model) and "Concat" not in ops(result.model)
    (name, reason), = result.float_reasons.items()
    assert "Sub" in name and "is a dequantized constant" in reason


class SmallNet(torch.nn.Module):
    """Two convs (one grouped) with a residual add, a pool and a classifier."""

    def __init__(self):
        super().__init__()
        self.conv1, self.conv2 = torch.nn.Conv2d(3, 16, 3, padding=1), torch.nn.Conv2d(16, 16, 3, padding=1, groups=4)
        self.fc = torch.nn.Linear(16, 10)

    def forward(self, x):
        y = torch.relu(self.conv1(x))
        y = torch.relu(self.conv2(y)) + y
        return self.fc(torch.flatten(torch.nn.functional.adaptive_avg_pool2d(y, 1), 1))


def _export_small_net(path) -> None:
    """:class:`SmallNet` (seed 0) by torch.onnx's TorchScript path, batch fixed at 1, into ``path``."""
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(SmallNet().eval(), torch.randn(1, 3, 8, 8), path, dynamo=False, input_names=["input"])


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


@pytest.mark.parametrize("op", ["AveragePool", "GlobalAveragePool"])
def test_an_average_pool_on_its_input_grid_converts_its_ties_counted_apart(op):
    """quantize_static gives an AveragePool's output its input's grid: a 2x2 window's mean is then exactly half a step
    for a quarter of its sums. The QAT model's float noise decides those ties (nudged by 8 ulps it decides them
    otherwise itself) and onnxruntime's integer pool, as its own session of the QDQ file runs it, rounds them
    otherwise: a step apart on about one in eight, which refused a U-Net's conversion. The pool is integer, held to
    one step op by op, its ties counted apart and said."""
    b = Builder()
    y = b.node(op, [b.qdq("x", 0.05, 0)], **({"kernel_shape": [2, 2], "strides": [2, 2]} if op == "AveragePool" else {}))
    model = b.model([("x", [8, 16, 4, 4])], [b.qdq(y, 0.05, 0)])
    feeds = {"x": np.abs(np.random.default_rng(3).standard_normal((64, 16, 4, 4))).astype(np.float32) * 3}
    result = quantize_qat_export(model, inputs=feeds)
    assert "QLinear" + op in ops(result.model), ops(result.model)
    v = result.verification
    assert v.local_steps == 1 and v.local_tied == 1 and "exact ties" in str(v), v


def _optimized_ops(path, tmp_path, level=None):
    """The op types (with their domain) of ``path`` as an onnxruntime session runs it (its default level unless
    ``level`` says)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    if level is not None:
        options.graph_optimization_level = level
    options.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    options.log_severity_level = 3  # its note that the saved graph holds this CPU's layouts
    ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    return collections.Counter(f"{n.domain}:{n.op_type}" for n in onnx.load(tmp_path / "optimized.onnx").graph.node)


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


def _quantize_static(fp32, out, feeds, **options):
    """onnxruntime's ``quantize_static`` (QDQ unless ``quant_format`` says) of ``fp32`` calibrated on ``feeds``,
    warnings silenced."""
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, quantize_static

    class Reader(CalibrationDataReader):
        def __init__(self):
            self.items = iter(feeds)

        def get_next(self):
            return next(self.items, None)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        quantize_static(str(fp32), str(out), Reader(), **{"quant_format": QuantFormat.QDQ, **options})


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


def _tiny_bert(tmp_path):
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    model = BertForSequenceClassification(BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                                     intermediate_size=64, vocab_size=200,
                                                     max_position_embeddings=32)).eval()
    for name, p in model.named_parameters():  # trained-like biases (torch's export shares equal ones)
        if name.endswith("bias"):
            torch.nn.init.normal_(p, std=0.02)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(model, (torch.randint(0, 200, (1, 16)),), tmp_path / "bert.onnx", dynamo=False,
                          input_names=["input_ids"], output_names=["logits"],
                          dynamic_axes={"input_ids": {0: "batch", 1: "sequence"}})
    return tmp_path / "bert.onnx"


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


FIXTURE_DIR = Path(__file__).parents[1] / "fixtures" / "interop"
READ_FIRST = ("qonnx", "sim")  # QONNX, AIMET's float model with encodings: tested by their own tests below
FIXTURES = sorted(p for p in FIXTURE_DIR.glob("*-small-resnet.onnx") if not any(k in p.stem for k in READ_FIRST))
TRANSFORMER_FIXTURES = sorted(p for p in FIXTURE_DIR.glob("*-small-bert.onnx")
                              if not any(k in p.stem for k in READ_FIRST))


def _runtime_float_layers(path, tmp_path):
    """The Conv / Gemm / MatMul onnxruntime's own QDQ fusion (extended level) leaves float in ``path``."""
    import onnxruntime as ort

    kinds = _optimized_ops(path, tmp_path, ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED)
    return sum(n for key, n in kinds.items() if key.split(":")[1] in ("Conv", "Gemm", "MatMul", "FusedConv"))


@pytest.mark.parametrize("path", FIXTURES, ids=[p.stem for p in FIXTURES])
def test_other_tools_exports_convert_with_every_layer_integer(path, tmp_path):
    """Each committed export of another tool (``scripts/interop_exports/``: Brevitas's QCDQ with int32 biases (and
    4-bit weights clipped to +-7: one file for every CPU, as AIMET's W4A8),
    NNCF's QDQ with its BatchNorms apart, ModelOpt's with only layer inputs quantized, torchao's PT2E with a dynamic
    batch, PyTorch's FX graph mode QAT converted to its quantized ops and exported by TorchScript, TF Model
    Optimization's through tf2onnx with its weights and BatchNorms folded into float kernels that lie
    on int8 grids, channels last): every Conv / Gemm / MatMul whose output a QuantizeLinear reads is integer (ModelOpt quantizes no residual
    add, torchao's x86 quantizer not the conv before one: those convs stay float, each with that reason, as
    onnxruntime's own fusion leaves them); verified on 256 samples, op by op within a step of the file run as
    written, the file left as it was."""
    before = path.read_bytes()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UnconvertedOpsWarning)
        result = quantize_qat_export(path, tmp_path / "int8.onnx")
    kinds = collections.Counter(ops(result.model))
    left = kinds["Conv"] + kinds["Gemm"] + kinds["MatMul"]
    assert left <= _runtime_float_layers(path, tmp_path), kinds  # never more float than onnxruntime's own fusion
    residual_float = path.stem.startswith(("modelopt", "torchao"))
    assert kinds["QLinearConv"] + left >= 12 and (left == 0) == (not residual_float), kinds
    convs = {n.name or f"Conv #{i}" for i, n in enumerate(onnx.load(path).graph.node) if n.op_type == "Conv"}
    assert all("not by one QuantizeLinear alone" in why for name, why in result.float_reasons.items()
               if name in convs or name.endswith("Conv")), result.float_reasons
    assert len(result.grid_weights) == (13 if path.stem.startswith("tfmot") else 0), result.grid_weights
    assert (result.avx2_path is None) == ("w4" in path.stem), result.weights_note  # 4-bit weights: one file
    v = result.verification
    # class ids: random weights leave 1-5% of the samples within a step of a tie (torchao's: onnxruntime's own
    # fusion flips 2 of 256, recal's 3, every integer tensor within a step; tfmot's: generated inputs, far from its
    # training data, leave its logits near ties, and a default session of the file itself agrees on 96.5%)
    assert v.samples >= 256 and v.local_steps <= 1 and v.local_share <= 1e-3 and v.argmax_agreement >= 0.95, v
    assert path.read_bytes() == before


@pytest.mark.parametrize("name", ["tfmot-mobilenetv2", "tflite-mobilenetv2"])
def test_tensorflows_keras_applications_mobilenetv2_converts_with_every_layer_integer(name, tmp_path):
    """keras.applications' own MobileNetV2 (depthwise convs, ReLU6, stride-2 blocks behind ZeroPadding2D) through
    TF Model Optimization's QAT (``scripts/interop_exports/tfmot_export.py``), by tf2onnx (its 53 float kernels,
    weight quantizers and BatchNorms folded, read back from their int8 grids, the pads folded into the convs first)
    and as TFLite's integer model (int8 activations with zero points): every conv and the classifier integer,
    verified on 256 samples within a step op by op, the file left as it was."""
    path = FIXTURE_DIR / f"{name}.onnx"
    before = path.read_bytes()
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnconvertedOpsWarning)
        result = quantize_qat_export(path, tmp_path / "int8.onnx")
    kinds = collections.Counter(ops(result.model))
    assert kinds["QLinearConv"] == 52 and kinds["QGemm"] == 1, kinds
    assert kinds["Conv"] == kinds["Gemm"] == kinds["MatMul"] == 0, kinds
    assert len(result.grid_weights) == (53 if name.startswith("tfmot") else 0), result.grid_weights
    v = result.verification
    assert v.samples >= 256 and v.local_steps <= 1 and v.local_share <= 1e-3, v
    assert path.read_bytes() == before


def _reaches(model, name, ops, moves=("Transpose", "Reshape", "Cast", "Identity")):
    """Whether ``name`` is made by one of ``ops`` (through ``moves``); an initializer counts as "constant"."""
    made = {o: n for n in model.graph.node for o in n.output}
    node = made.get(name)
    while node is not None and node.op_type not in ops and node.op_type in moves:
        name = node.input[0]
        node = made.get(name)
    if node is None:
        return "constant" in ops and name in {t.name for t in model.graph.initializer}
    return node.op_type in ops


def _float_weight_layers(model):
    """The MatMul / Gemm nodes reading a constant weight in float (through Q / Clip / DQ, Transpose, Reshape, Cast)."""
    moves = ("QuantizeLinear", "Clip", "DequantizeLinear", "Transpose", "Reshape", "Cast", "Identity")
    return [n.name for n in model.graph.node
            if n.op_type in ("MatMul", "Gemm") and _reaches(model, n.input[1], ("constant", "Constant"), moves)]


@pytest.mark.parametrize("path", TRANSFORMER_FIXTURES, ids=[p.stem for p in TRANSFORMER_FIXTURES])
def test_other_tools_transformer_exports_convert_every_weight_layer(path, tmp_path):
    """A Hugging Face BERT quantized by another tool (``scripts/interop_exports/*_bert_export.py``: ModelOpt's
    quantized Linear inputs, NNCF's transformer preset with its attention's Q·Kᵀ, SmoothQuant scales and int8
    embedding tables, torchao's PT2E with its int8 weights stored as integers, Brevitas's layerwise QCDQ with its
    initializers listed as graph inputs too, AIMET's with its ops' outputs quantized): every Linear becomes an integer
    matmul (or, where the tool left its input float, int8 weights in MatMulNBits, with the reason), an attention
    product whose two inputs the tool quantized too, the others stay float (two float
    activations, no weight: as onnxruntime's own fusion leaves them), the embedding tables int8 where the tool
    quantized them; verified on 256 samples within a step op by op of the file run as written, the file left as it
    was."""
    before = path.read_bytes()
    source = onnx.load(path)
    linears = _float_weight_layers(source)
    assert len(linears) == 14  # 12 encoder Linears, pooler, classifier
    products = [n for n in source.graph.node if n.op_type == "MatMul" and n.name not in linears]
    quantized = [n for n in products if all(_reaches(source, x, ("DequantizeLinear",)) for x in n.input)]
    assert len(products) == 4 and len(quantized) == (2 if path.stem.startswith(("nncf", "aimet")) else 0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UnconvertedOpsWarning)
        result = quantize_qat_export(path, tmp_path / "int8.onnx")
    kinds = collections.Counter(ops(result.model))
    assert _float_weight_layers(result.model) == [], kinds
    integer = kinds["MatMulIntegerToFloat"] + kinds["QGemm"] + kinds["QLinearMatMul"]
    assert integer + kinds["MatMulNBits"] == 14 + len(quantized), kinds
    # a Linear whose input the tool left float (AIMET's attention output, after its float P·V) keeps int8 weights,
    # computed in float, and says why
    nbits = [n.name for n in result.model.graph.node if n.op_type == "MatMulNBits"]
    assert len(nbits) == (2 if path.stem.startswith("aimet") else 0), kinds
    assert all("is float" in result.float_reasons[name] for name in nbits), result.float_reasons
    assert kinds["MatMul"] == len(products) - len(quantized), kinds
    if path.stem.startswith("nncf"):  # its int8 tables, read as int8 and scaled by row
        assert sum(n.op_type == "Gather" and n.name.endswith("_int8") for n in result.model.graph.node) == 3
    v = result.verification
    assert v.samples >= 256 and v.local_steps <= 1 and v.local_share <= 1e-3 and v.argmax_agreement >= 0.99, v
    floats = sum(t.data_type == onnx.TensorProto.FLOAT and np.prod(t.dims) > 4096 for t in source.graph.initializer)
    ratio = (tmp_path / "int8.onnx").stat().st_size / path.stat().st_size
    # ModelOpt and NNCF store float weights; torchao and Brevitas int8 ones, and their rows of the constant position
    # and token-type tables are gathered once (4096 floats where a 256-float table was)
    assert ratio < (0.4 if floats > 14 else 1.05), ratio
    assert path.read_bytes() == before


def test_modelopts_onnx_int4_awq_export_becomes_matmulnbits_exactly(tmp_path):
    """NVIDIA ModelOpt's ONNX INT4 quantizer (AWQ, its path for LLMs; ``scripts/interop_exports/
    modelopt_onnx_export.py``) on a trained BERT: every MatMul it quantized (int4 blocks of 128 along K) becomes
    ``MatMulNBits`` at those blocks, verified on 256 samples within float rounding, the file left as it was. At its
    defaults it also quantizes the pooler's and classifier's Gemm (transB=1) with scales in blocks along K but axis 0
    written, a file onnxruntime refuses: refused before any work, by node, with the axis that fits."""
    path = FIXTURE_DIR / "modelopt-int4-awq-bert.onnx"
    before = path.read_bytes()
    blocked = [n for n in onnx.load(path).graph.node if n.op_type == "DequantizeLinear"
               and any(a.name == "block_size" and a.i == 128 for a in n.attribute)]
    assert len(blocked) == 12  # two layers' six Linears
    result = quantize_qat_export(path, tmp_path / "int4.onnx")
    nbits = [n for n in result.model.graph.node if n.op_type == "MatMulNBits"]
    assert len(nbits) == 12 and "DequantizeLinear" not in ops(result.model), collections.Counter(ops(result.model))
    assert all({(a.name, a.i) for a in n.attribute} >= {("bits", 4), ("block_size", 128)} for n in nbits)
    v = result.verification
    assert v.samples >= 256 and v.argmax_agreement == 1.0 and v.max_abs_diff <= 1e-5 * v.output_range, v
    assert path.read_bytes() == before
    wrong_axis = FIXTURE_DIR / "refused" / "modelopt-int4-awq-bert-gemm.onnx"
    with pytest.raises(ModelError, match=r"blocks of 128 along axis 0, which needs \[1, 128\]; that scale gives "
                                         r"blocks along axis 1, the K axis of the Gemm \(transB=1\)"):
        quantize_qat_export(wrong_axis, tmp_path / "refused.onnx")
    assert not (tmp_path / "refused.onnx").exists()


@pytest.mark.parametrize("name, quantized, floats", [
    ("modelopt-onnx-int8-bert", 16, 0), ("modelopt-onnx-int8-resnet", 12, 4),
    ("modelopt-onnx-int8-fp16-bert", 16, 0), ("modelopt-onnx-int8-fp16-resnet", 12, 4),
    ("nncf-onnx-int8-bert", 16, 0), ("nncf-onnx-int8-resnet", 12, 0),
    ("quark-xint8-bert", 18, 0), ("quark-xint8-resnet", 13, 0),
    ("quark-a8w8-bert", 18, 0), ("quark-a8w8-resnet", 13, 0)])
def test_onnx_quantizers_exports_convert_with_every_quantized_layer_integer(name, quantized, floats, tmp_path):
    """What other tools' post-training quantizers of ONNX files write (``scripts/interop_exports/``: NVIDIA
    ModelOpt's ONNX INT8 quantization, NNCF's ONNX backend with its transformer preset, AMD Quark's XINT8 with its
    int8 biases on power-of-two grids and its A8W8 in onnxruntime's com.microsoft Q/DQ): every MatMul / Conv / Gemm
    whose inputs they quantized is integer (the BERTs' Linears and the attention products they quantized; ModelOpt's
    files at its default ``high_precision_dtype="fp16"`` compute in float16, and in float32 once converted), but
    ModelOpt's ResNet convs before a residual add, whose outputs it did not quantize: float with that reason, as
    onnxruntime's own fusion leaves them. Layers a tool left unquantized (ModelOpt's classifiers, too small for it)
    stay as written; verified on 256 samples, op by op within a step of the file run as written."""
    path = FIXTURE_DIR / f"{name}.onnx"
    source = onnx.load(path)
    layers = [n for n in source.graph.node if n.op_type in ("Conv", "MatMul", "Gemm")
              and all(_reaches(source, x, ("DequantizeLinear",)) for x in n.input[:2])]
    assert len(layers) == quantized
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UnconvertedOpsWarning)
        result = quantize_qat_export(path, tmp_path / "int8.onnx")
    kinds = collections.Counter(ops(result.model))
    integer = kinds["MatMulIntegerToFloat"] + kinds["QLinearMatMul"] + kinds["QLinearConv"] + kinds["QGemm"]
    assert kinds["Conv"] == floats and integer >= quantized - floats, kinds  # (a Gemm past a Flatten: integer too)
    assert kinds["Conv"] <= _runtime_float_layers(path, tmp_path), kinds  # never more than onnxruntime's own fusion
    assert all("not by one QuantizeLinear alone" in why for node, why in result.float_reasons.items()
               if node.endswith("Conv")), result.float_reasons
    v = result.verification
    assert v.samples >= 256 and v.local_steps <= 1 and v.local_share <= 1e-3 and v.argmax_agreement >= 0.98, v


def test_nncfs_openvino_export_is_refused_with_the_way_to_qdq():
    b = Builder()
    y = b.node("FakeQuantize", ["x", b.const(np.float32(-1)), b.const(np.float32(1)), b.const(np.float32(-1)),
                                b.const(np.float32(1))], domain="org.openvinotoolkit", levels=256)
    model = b.model([("x", [1, 4])], [b.qdq(y, 0.1, 128)])
    model.opset_import.append(helper.make_opsetid("org.openvinotoolkit", 1))
    with pytest.raises(ModelError, match="FakeQuantize \\(org.openvinotoolkit\\).*nncf.strip"):
        quantize_qat_export(model)


def test_aimets_w4a8_export_converts_on_finer_weight_grids_and_its_a16w8_is_refused(tmp_path):
    """AIMET at ``default_param_bw=4`` quantizes each float weight with a QuantizeLinear to int4 and keeps its
    BatchNorms apart: folded into the convs, their biases fall between int32 steps of a 4-bit weight's scale, which
    moved 0.5% of the integers by a step (refused). Held on a grid 8 times finer (the same weights, within +-64) every
    layer is integer, one file exact on every CPU. At ``default_output_bw=16`` every activation is 16-bit: refused,
    saying so (``scripts/interop_exports/aimet_export.py``)."""
    result = quantize_qat_export(FIXTURE_DIR / "aimet-w4a8-small-resnet.onnx", tmp_path / "int8.onnx")
    kinds = collections.Counter(ops(result.model))
    assert kinds["QLinearConv"] == 12 and "Conv" not in kinds and result.rewrites["finer_weight_grids"] == 12, kinds
    assert result.avx2_path is None and "none saturates" in result.weights_note
    assert result.verification.local_share <= 1e-3 and result.verification.local_steps <= 1, result.verification
    with pytest.raises(ModelError, match=r"every activation is quantized to 16 bits \(uint16"):
        quantize_qat_export(FIXTURE_DIR / "refused" / "aimet-a16w8-small-resnet.onnx", tmp_path / "a16.onnx")
    assert not (tmp_path / "a16.onnx").exists()


@pytest.mark.parametrize("name, qcdq", [("brevitas-qonnx-small-resnet", "brevitas-small-resnet"),
                                        ("brevitas-qonnx-dynamo-small-resnet", "brevitas-small-resnet"),
                                        ("brevitas-qonnx-w4-small-resnet", "brevitas-w4-small-resnet"),
                                        ("brevitas-qonnx-small-bert", "brevitas-small-bert")])
def test_brevitas_qonnx_exports_convert_to_what_their_qcdq_exports_convert_to(name, qcdq, tmp_path):
    """Brevitas's ``export_qonnx`` (QONNX's ``Quant``, a domain onnxruntime cannot run) of the model its QCDQ fixture
    holds: the ResNet at 8 bits (by TorchScript, and by its dynamo path: opset 20, initializers and weights' slices
    listed as graph inputs) and with 4-bit weights per channel, the BERT quantized layer by layer, its initializers
    listed as graph inputs too (``scripts/interop_exports/brevitas_export.py``, ``brevitas_bert_export.py``). Read as
    the QCDQ it means: every layer integer, verified on 256 samples against that reading, no input but the model's
    own, and the converted model computes exactly what the QCDQ export's conversion computes, with the same integer
    ops (``scripts/interop_exports/qonnx_check.py`` checks the reading against qonnx's own executor)."""
    path = FIXTURE_DIR / f"{name}.onnx"
    before = path.read_bytes()
    result = quantize_qat_export(path, tmp_path / "int8.onnx")
    twin = quantize_qat_export(FIXTURE_DIR / f"{qcdq}.onnx", tmp_path / "qcdq.int8.onnx")
    kinds = collections.Counter(ops(result.model))

    def integer(model):
        return {op: n for op, n in collections.Counter(ops(model)).items()
                if op.startswith(("QLinear", "QGemm", "MatMulInteger"))}

    assert integer(result.model) == integer(twin.model), kinds
    assert kinds["QGemm"] + kinds["QLinearConv"] == (14 if "bert" in name else 13), kinds
    assert not result.unconverted and "Quant nodes are read as the QuantizeLinear" in result.notes[0]
    assert len(result.model.graph.input) == 1  # the model's own: initializers listed beside it are constants
    assert (result.avx2_path is None) == ("w4" in name), result.weights_note
    v = result.verification
    assert v.samples >= 256 and v.local_steps <= 1 and v.local_share <= 1e-3, v
    _same_with_and_without_optimizations(result.model)
    ours, theirs = (ort_session(r.model) for r in (result, twin))
    for seed in range(32):
        (x,) = generated_inputs(result.model, 1, seed=seed).values()  # (the exports name the input differently)
        np.testing.assert_array_equal(ours.run(None, {ours.get_inputs()[0].name: x})[0],
                                      theirs.run(None, {theirs.get_inputs()[0].name: x})[0])
    assert path.read_bytes() == before


@pytest.mark.parametrize("legacy", [False, True], ids=["1.0.0", "0.6.1"])
def test_a_float_model_with_aimets_encodings_converts_to_what_they_mean(legacy, tmp_path):
    """AIMET's ``QuantizationSimModel.export``: the float model and its encodings (both layouts). The converted model
    is integer and computes what AIMET's simulation means, ``x = (q + offset) * scale`` with ``q`` clamped to
    ``[0, 255]``, computed here by torch's fake quantizers (zero point ``-offset``), within one output step."""
    model, encodings, w = aimet_layer(legacy)
    result = quantize_qat_export(model, tmp_path / "int8.onnx", encodings=encodings)
    assert ops(result.model).count("QLinearConv") == 1 and not result.unconverted, ops(result.model)
    assert "AIMET encodings: 2 activations quantized and 1 parameters" in result.notes[0]
    x = torch.from_numpy(np.random.default_rng(1).standard_normal((2, 3, 6, 6)).astype(np.float32))
    weight = torch.tensor(onnx.numpy_helper.to_array(next(t for t in model.graph.initializer if t.name == w)))
    fq_x = torch.fake_quantize_per_tensor_affine(x, 0.03, 120, 0, 255)
    fq_w = torch.fake_quantize_per_channel_affine(weight, torch.tensor([0.004, 0.005, 0.0045, 0.006]),
                                                  torch.full((4,), 128, dtype=torch.int32), 0, 0, 255)
    # (torch's per-channel form takes the unsigned grid too: zero point 128 is AIMET's offset -128)
    want = torch.fake_quantize_per_tensor_affine(torch.relu(torch.nn.functional.conv2d(fq_x, fq_w, padding=1)),
                                                 0.02, 0, 0, 255).numpy()
    got = run(result.model, {"x": x.numpy()})[0]
    assert np.abs(got - want).max() <= 0.02 + 1e-6 and np.mean(got != want) < 0.01


@pytest.mark.parametrize("changes, message", [
    ({"name": "nothing"}, r"the encodings name tensor 'nothing', which the model does not have"),
    ({"offset": [-128] * 3}, r"param_encodings entry 'w\d+': 4 scales and 3 offsets"),
    ({"offset": [-300] * 4}, r"param_encodings entry 'w\d+': offset \[-300, -300, -300, -300\] is not an integer in "
                             r"\[-255, 0\]"),
    ({"scale": [0.004, 0.0, 0.1, 0.1]}, r"scale \[0.004, 0.0, 0.1, 0.1\] is not finite and positive"),
    ({"bw": "eight"}, r"param_encodings, tensor 'w\d+', field 'bw': Input should be a valid integer"),
    ({"enc_type": "PER_BLOCK"}, r"field 'enc_type': Input should be 'PER_TENSOR' or 'PER_CHANNEL'"),
    ({"scale": [0.004] * 3, "offset": [-128] * 3}, r"parameter 'w\d+' of shape \[4, 3, 3, 3\] has 3 per-channel "
                                                   r"encodings, and its readers do not tell along which axis"),
], ids=["name", "counts", "offset", "scale", "type", "blocks", "axis"])
def test_aimets_encodings_that_do_not_fit_are_refused_by_name(changes, message, tmp_path):
    """Encodings that name a tensor the model lacks, or hold values AIMET's grid cannot mean: refused before any
    work, naming the section, the tensor and the field, nothing written."""
    model, encodings, _ = aimet_layer(**changes)
    with pytest.raises(ModelError, match=message):
        quantize_qat_export(model, tmp_path / "int8.onnx", encodings=encodings)
    assert not list(tmp_path.iterdir())


def test_aimets_encodings_files_that_are_not_its_own_are_refused(tmp_path):
    """Not JSON, another version's layout, and encodings beside a model that is already QDQ: each refused, saying
    so; a float model without its encodings is told that it can bring them."""
    model, encodings, _ = aimet_layer()
    bad = tmp_path / "bad.encodings"
    bad.write_text("{not json")
    with pytest.raises(ModelError, match=r"bad.encodings: not a JSON encodings file"):
        quantize_qat_export(model, encodings=bad)
    with pytest.raises(ModelError, match=r"encodings version 2.0.0; the converter reads versions up to 0.6.1 and "
                                         r"1.0.0, .* aimet_torch.onnx.export, whose QDQ model converts"):
        quantize_qat_export(model, encodings={**encodings, "version": "2.0.0"})
    legacy = aimet_layer(legacy=True)[1]
    del legacy["activation_encodings"]["x"][0]["scale"]
    with pytest.raises(ModelError, match=r"activation_encodings\['x'\]: an integer encoding without its scale"):
        quantize_qat_export(model, encodings=legacy)
    with pytest.raises(ModelError, match=r"is not a QAT model: .* converts with its encodings: encodings="):
        quantize_qat_export(model)
    with pytest.raises(ModelError, match=r"is already quantized .* AIMET's encodings go with the float model"):
        quantize_qat_export(FIXTURE_DIR / "aimet-small-resnet.onnx", encodings=encodings)


@pytest.mark.parametrize("name", ["aimet-sim-small-resnet", "aimet-sim-small-bert"])
def test_aimets_sim_export_converts_with_every_layer_integer(name, tmp_path):
    """AIMET's classic QAT export (``sim.export``: the float model, the ResNet with its BatchNorms, and its
    ``.encodings``; ``scripts/interop_exports/aimet_export.py`` and ``aimet_bert_export.py``, which check recal's
    reading against AIMET's simulation itself): every layer integer (the BatchNorms folded into the integer convs;
    the BERT's Linears integer matmuls but the attention output's, whose input AIMET leaves float after its float
    P·V: int8 weights in MatMulNBits, as from its QDQ export), verified on 256 samples within a step op by op of what
    the encodings mean; the CLI takes the same files with ``--encodings``."""
    from recal_app.cli import main

    path = FIXTURE_DIR / f"{name}.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UnconvertedOpsWarning)
        result = quantize_qat_export(path, tmp_path / "int8.onnx", encodings=path.with_suffix(".encodings"))
    kinds = collections.Counter(ops(result.model))
    if "bert" in name:
        assert kinds["MatMulIntegerToFloat"] == 12 and kinds["MatMulNBits"] == 2 and "Gemm" not in kinds, kinds
        assert _float_weight_layers(result.model) == []
    else:
        assert kinds["QLinearConv"] == 12 and kinds["QGemm"] == 1 and kinds["QLinearAdd"] == 4, kinds
        assert "BatchNormalization" not in kinds and not result.unconverted
    _same_with_and_without_optimizations(result.model)
    v = result.verification
    assert v.samples >= 256 and v.local_steps <= 1 and v.local_share <= 1e-3, v
    assert main(["quantize-qat-export", str(path), str(tmp_path / "cli.onnx"), "--encodings",
                 str(path.with_suffix(".encodings"))]) == 0


def _same_with_and_without_optimizations(model):
    """The converted model gives the same outputs in a default onnxruntime session and with optimizations off."""
    import onnxruntime as ort

    feeds = generated_inputs(model, 1, seed=3)
    for got, want in zip(run(model, feeds), run(model, feeds, level=ort.GraphOptimizationLevel.ORT_DISABLE_ALL)):
        np.testing.assert_array_equal(got, want)


def ort_session(model):
    import onnxruntime as ort

    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


def _qonnx_layer(**overrides):
    """x -> Quant -> Conv(Quant(w)) -> Quant: a QONNX model with one quantizer's inputs or attributes as given."""
    b = Builder()
    rng = np.random.default_rng(0)
    spec = {"scale": 0.05, "zero_point": 0, "bits": 8, "signed": 1, "narrow": 0, **overrides}
    scale = b.const(np.asarray(spec["scale"], np.float32)) if not isinstance(spec["scale"], str) else spec["scale"]
    attrs = {k: spec[k] for k in ("signed", "narrow", "rounding_mode") if k in spec and spec[k] is not None}
    x = b.node("Quant", ["x", scale, b.const(np.asarray(spec["zero_point"], np.float32)),
                         b.const(np.float32(spec["bits"]))], domain=QONNX_DOMAIN, **attrs)
    w = qonnx_quant(b, b.const(rng.standard_normal((4, 3, 3, 3)).astype(np.float32) * 0.3), 0.01, 0, 8, narrow=1)
    y = qonnx_quant(b, b.node("Conv", [x, w], pads=[1, 1, 1, 1]), 0.0937, 0, 8)  # no tie at every 200th
    inputs = [("x", [2, 3, 6, 6])] + ([("s", [])] if isinstance(spec["scale"], str) else [])
    return qonnx_model(b, inputs, [(y, [2, 4, 6, 6])])


@pytest.mark.parametrize("overrides, message", [
    ({"scale": "s"}, r"its scale is computed at run time \(dynamic quantization\), not a constant"),
    ({"bits": 16}, r"an activation quantized to 16 bits; onnxruntime's integer kernels take 8"),
    ({"bits": 1}, r"bit width \[1.0\], expected one integer from 2 to 32 \(1 bit is QONNX's BipolarQuant"),
    ({"rounding_mode": "FLOOR"}, r"an activation rounded FLOOR; QuantizeLinear rounds half to even"),
    ({"rounding_mode": "STOCHASTIC"}, r"rounding mode 'STOCHASTIC', expected one of ROUND"),
    ({"zero_point": 0.5}, r"zero point \[0.5\] is not an integer"),
    ({"zero_point": 200}, r"zero point \[200.0\] is outside its range \[-128, 127\]"),
    ({"scale": np.full((1, 3, 6, 1), 0.05)}, r"scale and zero point of shape \[1, 3, 6, 1\] vary along several axes"),
    ({"scale": -0.05}, r"its scale holds values that are not finite and positive"),
    ({"scale": np.full((1, 5, 1, 1), 0.05)}, r"scale and zero point of shape \[1, 5, 1, 1\] do not broadcast over "
                                             r"its input 'x' of shape \[2, 3, 6, 6\]"),
    ({"narrow": None}, r"'narrow' is not set, and QONNX's specification \(0\) and its implementation \(1\)"),
], ids=["dynamic", "16-bit", "1-bit", "floor", "unknown-mode", "fractional-zp", "zp-range", "two-axes", "negative",
        "no-broadcast", "no-narrow"])
def test_a_qonnx_quantizer_with_no_qdq_form_is_refused_by_name(overrides, message, tmp_path):
    """What QONNX can say and QuantizeLinear / DequantizeLinear cannot: refused before any work, naming the file, the
    node and the value, nothing written; the same layer at its defaults converts."""
    with pytest.raises(ModelError, match=r"the model: QONNX Quant 'Quant\d+': " + message):
        quantize_qat_export(_qonnx_layer(**overrides), tmp_path / "int8.onnx")
    assert not list(tmp_path.iterdir())
    result = quantize_qat_export(_qonnx_layer(), tmp_path / "ok.onnx")
    assert ops(result.model).count("QLinearConv") == 1 and not result.unconverted


def test_qonnx_ops_with_no_integer_kernel_are_refused_with_what_is_read():
    """QONNX's Trunc (Brevitas's TruncAvgPool) has no QDQ form: refused naming it, saying that its Quant is read."""
    b = Builder()
    x = qonnx_quant(b, "x", 0.05, 0, 8)
    y = b.node("Trunc", [x, b.const(np.float32(0.05)), b.const(np.float32(0)), b.const(np.float32(8)),
                         b.const(np.float32(4))], domain=QONNX_DOMAIN)
    with pytest.raises(ModelError, match=r"Trunc \(qonnx.custom_op.general\); this is QONNX, whose integer Quant the "
                                         r"converter reads, but not its Trunc"):
        quantize_qat_export(qonnx_model(b, [("x", [2, 3])], [(y, [2, 3])]))


@pytest.mark.parametrize("spatial, global_pool", [(["h", "w"], False), ([3, 3], True)], ids=["dynamic", "static"])
def test_an_average_pool_past_the_input_means_the_same_in_the_integer_kernel(spatial, global_pool):
    """``nn.AvgPool2d(2560, ceil_mode=True)`` (Hugging Face's EfficientNet pooler) over a 2x2 map: onnxruntime's float
    pool averages the 4 values, its QDQ fusion with count_include_pad divided by the whole window (every output its
    zero point). The converted model, in a default session, gives the float pool's values; with a known spatial size
    the pool is the GlobalAveragePool it means. (A 3x3 map: a mean of 9 grid values is never a rounding tie.)"""
    b = Builder()
    y = b.node("AveragePool", [b.qdq("x", 0.01, 128)], kernel_shape=[64, 64], strides=[64, 64], ceil_mode=1,
               count_include_pad=1)
    model = b.model([("x", [2, 4, *spatial])], [b.qdq(y, 0.01, 128)])
    feeds = {"x": np.random.default_rng(0).uniform(-1, 1, (2, 4, 3, 3)).astype(np.float32)}
    expected = reference(model, feeds)[0]
    np.testing.assert_allclose(expected.reshape(2, 4), feeds["x"].mean((2, 3)), atol=0.011)  # the mean of 9
    result = quantize_qat_export(model, inputs=feeds)
    assert ("QLinearGlobalAveragePool" in ops(result.model)) == global_pool
    np.testing.assert_array_equal(run(result.model, feeds)[0], expected)  # a default session, as users run it


def test_biases_beyond_float32s_grid_are_said_to_be_the_qat_models():
    """A layer whose bias spans more int32 steps than float32 resolves (2^24: a nearly dead input, a tiny input scale)
    holds no float32 bias on its grid: the note says so, rather than blaming the conversion."""
    b = Builder()
    x = b.qdq("x", 0.01, 128)
    w = b.weight((2, 3, 1, 1))
    scales = _weight_scale(b, w).astype(np.float64) * 0.01
    bias = np.array([1000.5 * scales[0], 3e7 * scales[1]], np.float32)  # between two steps; beyond 2^24 steps
    y = b.node("Conv", [x, w, b.const(bias, "bias")])
    model = b.model([("x", [1, 3, 4, 4])], [b.qdq(y, 0.01, 128)])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UnconvertedOpsWarning)
        result = quantize_qat_export(model, verify=False)
    assert result.rounded_biases and result.coarse_biases and "beyond 2^24 steps" in result.rounded_biases_note


def test_a_twin_left_from_an_earlier_conversion_is_said_to_be_stale(tmp_path):
    """An 8-bit model converted to ``out.onnx`` writes ``out.x86-avx2.onnx`` beside it; a 7-bit one converted later to
    the same path has no twin, and the old file is named as not its own (it is the user's to remove)."""
    model, shape = _layer("Conv", True)
    feeds = {"x": np.random.default_rng(1).standard_normal(shape).astype(np.float32)}
    first = quantize_qat_export(model, tmp_path / "out.onnx", inputs=feeds)
    assert first.avx2_path == tmp_path / "out.x86-avx2.onnx"  # Builder's weights reach +-127
    small = onnx.ModelProto()
    small.CopyFrom(model)
    for t in small.graph.initializer:
        if t.data_type == TensorProto.INT8 and t.name.startswith("w"):
            t.CopyFrom(onnx.numpy_helper.from_array(onnx.numpy_helper.to_array(t) // 2, t.name))  # within +-64
    with pytest.warns(UserWarning, match="out.x86-avx2.onnx is not the twin of the model just written"):
        second = quantize_qat_export(small, tmp_path / "out.onnx", inputs=feeds)
    assert second.avx2_path is None and (tmp_path / "out.x86-avx2.onnx").exists()


def test_the_export_scripts_models_build_beside_torch_alone(monkeypatch):
    """``scripts/interop_exports/common.py`` runs in each peer tool's venv, so nothing in CI imports it otherwise:
    its models build, and its text batches are windows of real source labelled by their module."""
    monkeypatch.syspath_prepend(str(Path(__file__).parents[2] / "scripts" / "interop_exports"))
    common = __import__("common")
    torch.manual_seed(0)
    assert common.SmallResNet()(torch.randn(2, 3, common.SIZE, common.SIZE)).shape == (2, common.CLASSES)
    (ids, labels), = common.text_batches(1, batch=3)
    assert ids.shape == (3, common.TOKENS) and int(ids.max()) < 256 and labels.shape == (3,)
    assert common.small_bert().eval()(ids).shape == (3, common.TEXT_CLASSES)


@pytest.mark.parametrize("earlier", ["user's own twin", "an earlier verified pair"])
def test_a_failed_write_leaves_every_earlier_file_as_it_was(tmp_path, monkeypatch, earlier):
    """The model and its twin are one transaction over files this run creates: when writing fails, a user's own
    ``out.x86-avx2.onnx`` (and ``.data`` beside it) and an earlier conversion's verified pair stay byte for byte."""
    model, shape = _layer("Conv", True)
    feeds = {"x": np.random.default_rng(1).standard_normal(shape).astype(np.float32)}
    twin, data = tmp_path / "out.x86-avx2.onnx", tmp_path / "out.x86-avx2.onnx.data"
    if earlier == "user's own twin":
        twin.write_bytes(b"the user's own file")
        data.write_bytes(b"the user's own data")
    else:
        quantize_qat_export(model, tmp_path / "out.onnx", inputs=feeds)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    real_save = onnx.save_model
    calls = []

    def failing(proto, path, *args, **kwargs):  # the second file of the pair fails to write
        calls.append(path)
        if len(calls) == 2:
            raise OSError("disk error while writing")
        return real_save(proto, path, *args, **kwargs)

    monkeypatch.setattr(onnx, "save_model", failing)
    with pytest.raises(OSError, match="disk error"):
        quantize_qat_export(model, tmp_path / "out.onnx", inputs=feeds)
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before
