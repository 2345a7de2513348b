"""The QDQ forms other tools write, each on a tiny graph: int32 biases (DequantizeLinear(int32, s_x * s_w)), weights
with a zero point (uint8, recal's own format="qdq" output), a fixed batch verified on the promised sample count, a
QAT model that is itself not finite, every float node's reason, average pools, stale twins, failed writes."""

import warnings

import numpy as np
import onnx
import pytest
from onnx import TensorProto

from recal_onnx import ModelError, UnconvertedOpsWarning, quantize_qat_export
from tests.onnx.interop_graphs import OUT_SCALE, X_SCALE, _layer, _uint8_weight_conv, _weight_scale
from tests.support.onnx_graphs import Builder, ops, reference, run


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
