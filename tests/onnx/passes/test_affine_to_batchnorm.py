"""``affine_to_batchnorm`` on tiny graphs: its rewrites, the op types after, the numbers in onnxruntime."""

import numpy as np
import pytest

from recal_onnx.passes.affine_to_batchnorm import affine_to_batchnorm
from recal_onnx.passes.batchnorm_to_conv import batchnorm_to_conv
from recal_onnx.passes.conv_to_qlinearconv import conv_to_qlinearconv
from tests.onnx.passes.graphs import _apply, _x
from tests.support.onnx_graphs import Builder, ops, reference, run


@pytest.mark.parametrize("layout", ["channels last", "channels first"])
def test_a_per_channel_affine_on_a_quantized_activation_becomes_a_batchnorm(layout):
    """tf2onnx's inference BatchNorm (``Mul`` then ``Add`` by per-channel constants) on a quantized activation: a
    BatchNormalization computing exactly ``x * a + b`` (channels last: the integers transposed in, the ReLU and the
    QuantizeLinear after it moved inside, the integers transposed back), then a depthwise QLinearConv like any
    pre-activation BatchNorm, within an output step."""
    b = Builder()
    c = 4
    last = layout == "channels last"
    a = np.array([1.5, -0.7, 0.0, 2.0], np.float32)
    shift = np.array([0.1, -0.2, 0.3, 0.0], np.float32)
    shape = [2, 3, 3, c] if last else [2, c, 3, 3]
    y = b.node("Mul", [b.qdq("x", 0.03, 128), b.const(a if last else a.reshape(c, 1, 1))])
    y = b.node("Add", [y, b.const(shift if last else shift.reshape(c, 1, 1))])
    model = b.model([("x", shape)], [b.qdq(b.node("Relu", [y]), 0.02, 0)])
    feeds = _x(shape)
    expected = reference(model, feeds)[0]
    converted, (n, convs) = _apply(model, affine_to_batchnorm, batchnorm_to_conv)
    assert n == 1 and convs == 1 and not {"Mul", "Add", "BatchNormalization"} & set(ops(converted))
    assert ops(converted).count("Transpose") == (2 if last else 0)
    # the same numbers, but for a sum an FMA rounds once where Mul and Add round twice: a step off at a boundary
    steps = np.abs(run(converted, feeds)[0] - expected) / 0.02
    assert steps.max() <= 1 + 1e-3 and np.median(steps) == 0
    integer, _ = _apply(converted, conv_to_qlinearconv)
    assert "QLinearConv" in ops(integer) and "Conv" not in ops(integer)
    assert np.abs(run(integer, feeds)[0] - expected).max() <= 0.02 + 1e-6  # within one output step


def test_a_channels_last_affine_without_a_quantize_after_stays_as_it_is():
    """Channels last, the result read by something other than a QuantizeLinear (after the ReLU): no conv can take
    it, so the Mul and Add stay (and the converter names them)."""
    b = Builder()
    y = b.node("Mul", [b.qdq("x", 0.03, 128), b.const(np.array([1.5, 2.0], np.float32))])
    y = b.node("Add", [y, b.const(np.array([0.1, 0.2], np.float32))])
    model = b.model([("x", [1, 2, 2, 2])], [b.node("Sigmoid", [b.node("Relu", [y])])])
    converted, (n,) = _apply(model, affine_to_batchnorm)
    assert n == 0 and {"Mul", "Add"} <= set(ops(converted))
