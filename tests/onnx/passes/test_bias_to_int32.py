"""``bias_to_int32`` on tiny graphs: its rewrites, the op types after, the numbers in onnxruntime."""

import warnings

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from recal_onnx import quantize_qat_export
from recal_onnx.passes.bias_to_int32 import bias_to_int32
from recal_onnx.passes.shield_float_weights import shield_float_weights
from recal_onnx.passes.uint8_weights import uint8_weights
from tests.onnx.passes.graphs import _apply, _conv_graph, _folded_weight_graph, _x
from tests.support.onnx_graphs import Builder, ops, reference, run


def test_bias_to_int32_for_qdq_format():
    model = _conv_graph()
    feeds = _x([2, 3, 6, 6])
    expected = reference(model, feeds)[0]
    converted, (n, _) = _apply(model, bias_to_int32, uint8_weights)
    assert n == 1 and ops(converted).count("DequantizeLinear") == 4
    assert np.abs(run(converted, feeds)[0] - expected).max() <= 0.02 + 1e-6


@pytest.mark.parametrize("batch", [1, "batch"])  # static shapes: onnxruntime fuses MatMul + Add into a Gemm first
def test_bias_to_int32_lets_onnxruntime_fuse_a_3d_linear(batch, tmp_path):
    b = Builder()
    a = b.qdq("x", 0.05, 128)
    y = b.node("Add", [b.node("MatMul", [a, b.weight((8, 6), axis=1)]), b.const(np.linspace(-1, 1, 6, dtype=np.float32))])
    model = b.model([("x", [batch, 3, 8])], [y])
    feeds = _x([1, 3, 8])
    expected = reference(model, feeds)[0]
    converted, (n, _) = _apply(model, bias_to_int32, uint8_weights)  # as format="qdq" runs them
    assert n == 1
    np.testing.assert_allclose(run(converted, feeds)[0], expected, atol=1e-3)  # the bias rounded to s_x * s_w
    options = ort.SessionOptions()
    options.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    ort.InferenceSession(converted.SerializeToString(), options, providers=["CPUExecutionProvider"])
    fused = ops(onnx.load(str(tmp_path / "optimized.onnx")))
    assert {"MatMul", "Gemm"}.isdisjoint(fused) and {"QGemm", "MatMulIntegerToFloat"} & set(fused), fused


def test_a_float_layer_between_quantized_tensors_keeps_its_weights_in_a_default_session():
    """A float weight on no int8 grid, its input and output quantized (a mixed-precision export's float layer): a
    default onnxruntime session would quantize that weight to one int8 step itself (moving 11% of the next quantized
    tensor by up to 2 steps); the converted layer reads its input through a per-channel dequantization of its own,
    the same numbers, and the default session keeps the model as written, value for value. An integer layer in QDQ
    form is left as it is."""
    model, _ = _folded_weight_graph("Conv", on_grid="random")
    feeds = _x([2, 3, 6, 6])
    default = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    assert np.abs(run(model, feeds, level=default)[0] - reference(model, feeds)[0]).max() > 0.04  # moved
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = quantize_qat_export(model)
    assert result.verification.local_steps == 0, result.verification
    np.testing.assert_array_equal(run(result.model, feeds, level=default)[0], reference(model, feeds)[0])
    conv = next(name for name in result.float_reasons if name.startswith("Conv"))
    assert "on no int8 grid" in result.float_reasons[conv], result.float_reasons
    assert result.rewrites["shield_float_weights"] == 1
    integer, _ = _apply(_conv_graph(), bias_to_int32)
    assert _apply(integer, shield_float_weights)[1] == [0]
