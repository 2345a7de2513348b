"""``batchnorm_to_conv`` on tiny graphs: its rewrites, the op types after, the numbers in onnxruntime."""

import numpy as np

from recal_onnx.passes.batchnorm_to_conv import batchnorm_to_conv
from recal_onnx.passes.conv_to_qlinearconv import conv_to_qlinearconv
from tests.onnx.passes.graphs import _apply, _x
from tests.support.onnx_graphs import Builder, ops, reference, run


def test_batchnorm_on_a_quantized_activation_becomes_an_exact_depthwise_conv():
    """A pre-activation BatchNorm: its factor held exactly as +-64 with per-channel scale |a| / 64 (a negative and a
    zero factor too), its shift as the bias; then DQ -> Conv -> Relu -> Q converts like any conv."""
    b = Builder()
    c = 4
    gamma = np.array([1.5, -0.7, 0.0, 2.0], np.float32)
    beta, mean = np.array([0.1, -0.2, 0.3, 0.0], np.float32), np.array([0.05, 0.1, -0.1, 0.2], np.float32)
    var = np.array([1.0, 0.5, 2.0, 0.25], np.float32)
    y = b.node("BatchNormalization", [b.qdq("x", 0.03, 128), b.const(gamma), b.const(beta), b.const(mean),
                                      b.const(var)], epsilon=1e-5)
    y = b.qdq(b.node("Relu", [y]), 0.02, 0)
    model = b.model([("x", [2, c, 3, 3])], [y])
    feeds = _x([2, c, 3, 3])
    expected = reference(model, feeds)[0]
    converted, (n,) = _apply(model, batchnorm_to_conv)
    assert n == 1 and "BatchNormalization" not in ops(converted) and "Conv" in ops(converted)
    np.testing.assert_allclose(run(converted, feeds)[0], expected, atol=1e-6)
    integer, _ = _apply(converted, conv_to_qlinearconv)
    assert "QLinearConv" in ops(integer)
    assert np.abs(run(integer, feeds)[0] - expected).max() <= 0.02 + 1e-6  # within one output step
