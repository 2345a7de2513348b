"""``gemm_to_qgemm`` on tiny graphs: its rewrites, the op types after, the numbers in onnxruntime."""

import numpy as np
import onnx
import pytest

from recal_onnx.passes.fold_weight_transposes import fold_weight_transposes
from recal_onnx.passes.gemm_to_qgemm import gemm_to_qgemm
from tests.onnx.passes.graphs import _apply, _x
from tests.support.onnx_graphs import Builder, ops, reference, run


def test_gemm_to_qgemm_quantized_and_float_outputs():
    b = Builder()
    a = b.qdq("x", 0.05, 120)
    h = b.node("Gemm", [a, b.weight((16, 8)), b.const(np.zeros(16, np.float32) + 0.1)], transB=1)
    h = b.qdq(b.node("Relu", [h]), 0.04, 0)
    logits = b.node("Gemm", [h, b.weight((16, 4), axis=1), b.const(np.float32([0.1, -0.2, 0.3, 0.0]))])
    model = b.model([("x", [5, 8])], [logits])
    feeds = _x([5, 8])
    expected = reference(model, feeds)[0]
    converted, (n,) = _apply(model, gemm_to_qgemm)
    assert n == 2 and ops(converted).count("QGemm") == 2 and "Gemm" not in ops(converted)
    np.testing.assert_allclose(run(converted, feeds)[0], expected, atol=0.05)


@pytest.mark.parametrize("bias, quantized_out", [("on grid", True), ("on grid", False), ("off grid", True),
                                                 ("none", True)])
def test_matmul_3d_becomes_a_flattened_qgemm_or_matmul_integer_to_float(bias, quantized_out):
    """A ``[batch, tokens, hidden]`` MatMul (+ bias) becomes QGemm on ``[-1, hidden]`` and is reshaped back (bias
    and requantization inside the GEMM; float out where nothing quantizes it), for any batch and sequence; a float
    bias between its int32 steps (another tool's export) keeps MatMulIntegerToFloat, which adds it exactly."""
    b = Builder()
    a = b.qdq("x", 0.05, 128)
    w = b.weight((8, 6), axis=1)
    y = b.node("MatMul", [a, w])
    if bias != "none":
        scale = 0.05 * onnx.numpy_helper.to_array(next(t for t in b.inits if t.name.startswith("ws")))
        value = np.round(np.linspace(-3, 3, 6) / scale) * scale + (0.3 * scale if bias == "off grid" else 0)
        y = b.node("Add", [y, b.const(value.astype(np.float32))])
    model = b.model([("x", ["batch", "tokens", 8])], [b.qdq(y, 0.05, 128) if quantized_out else y])
    converted, (n,) = _apply(model, gemm_to_qgemm)
    kinds = ops(converted)
    assert n == 1 and (kinds.count("QGemm") == 1) == (bias != "off grid"), kinds
    assert ("MatMulIntegerToFloat" in kinds) == (bias == "off grid"), kinds
    for shape in ([2, 3, 8], [1, 5, 8]):
        feeds = _x(shape)
        expected, got = reference(model, feeds)[0], run(converted, feeds)[0]
        assert got.shape == expected.shape
        np.testing.assert_allclose(got, expected, atol=(0.05 if quantized_out else 1e-5) + 1e-6)


def test_fold_weight_transposes_lets_a_3d_linear_become_integer():
    b = Builder()
    a = b.qdq("x", 0.05, 128)
    w_t = b.node("Transpose", [b.weight((6, 8), axis=0)], perm=[1, 0])  # torch's Linear on [batch, tokens, hidden]
    y = b.node("Add", [b.node("MatMul", [a, w_t]), b.const(np.full(6, 0.2, np.float32))])
    model = b.model([("x", [2, 3, 8])], [b.qdq(y, 0.05, 128)])
    feeds = _x([2, 3, 8])
    expected = reference(model, feeds)[0]
    assert _apply(model, gemm_to_qgemm)[1] == [0]  # the transpose hides the weight
    converted, (n, m) = _apply(model, fold_weight_transposes, gemm_to_qgemm)
    assert (n, m) == (1, 1) and "Transpose" not in ops(converted) and "MatMulIntegerToFloat" in ops(converted)
    np.testing.assert_allclose(run(converted, feeds)[0], expected, atol=0.05 + 1e-6)


def test_attention_matmuls_with_a_quantized_output_become_qlinearmatmul_and_a_bias_first_is_a_bias():
    """P·V whose output a QuantizeLinear reads: QLinearMatMul (requantized in the kernel); Q·Kᵀ read by a float
    op: MatMulIntegerToFloat. A Linear written ``Add(bias, MatMul)`` converts as ``MatMul + bias``."""
    b = Builder()
    q, k = b.qdq("x", 0.05, 128), b.qdq("y", 0.04, 128)
    scores = b.node("Softmax", [b.node("MatMul", [q, k])], axis=-1)
    probs = b.qdq(scores, 1 / 255, 0)
    out = b.qdq(b.node("MatMul", [probs, b.qdq("v", 0.03, 128)]), 0.02, 128)
    w = b.weight((4, 6), axis=1)
    scale = 0.02 * onnx.numpy_helper.to_array(next(t for t in b.inits if t.name.startswith("ws")))
    bias = (np.round(np.linspace(-2, 2, 6) / scale) * scale).astype(np.float32)
    y = b.qdq(b.node("Add", [b.const(bias), b.node("MatMul", [out, w])]), 0.05, 128)
    model = b.model([("x", [2, 3, 4]), ("y", [2, 4, 3]), ("v", [2, 3, 4])], [y])
    converted, (n,) = _apply(model, gemm_to_qgemm)
    kinds = ops(converted)
    assert kinds.count("QLinearMatMul") == 1 and kinds.count("MatMulIntegerToFloat") == 1, kinds
    assert kinds.count("QGemm") == 1 and "Add" not in kinds, kinds
    feeds = {"x": _x([2, 3, 4])["x"], "y": _x([2, 4, 3], seed=2)["x"], "v": _x([2, 3, 4], seed=3)["x"]}
    np.testing.assert_allclose(run(converted, feeds)[0], reference(model, feeds)[0], atol=2 * 0.05 + 1e-6)
