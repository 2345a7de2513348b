"""``int8_passthrough`` on tiny graphs: its rewrites, the op types after, the numbers in onnxruntime."""

import numpy as np
import onnx
import pytest

from recal_onnx.passes.int8_passthrough import int8_passthrough
from recal_onnx.passes.pool_to_qlinear import pool_to_qlinear
from tests.onnx.passes.graphs import _apply, _x
from tests.support.onnx_graphs import Builder, ops, reference, run


@pytest.mark.parametrize("shape_op", ["Squeeze", "Flatten", "Squeeze Reshape"])
def test_pool_to_qlinear_through_a_shape_op_rounds_once(shape_op):
    """GlobalAveragePool -> Squeeze -> Q (tf2onnx's Keras/TF pooling; squeeze-excitation reshapes back to 4-D
    after it): one rounding, to the Q's grid, as the QDQ model computes; int8_passthrough leaves it to
    pool_to_qlinear instead of rounding at the input's scale first."""
    b = Builder()
    y = b.node("GlobalAveragePool", [b.qdq("x", 0.05, 0)])
    y = b.node("Squeeze", [y, b.const(np.array([2, 3], np.int64))]) if shape_op != "Flatten" else b.node("Flatten", [y])
    if shape_op.endswith("Reshape"):
        y = b.node("Reshape", [y, b.const(np.array([64, 1, 1, 8], np.int64))])
    model = b.model([("x", [64, 8, 4, 4])], [b.qdq(y, 0.004, 0)])  # a grid 12.5x finer than the input's
    feeds = {"x": np.random.default_rng(3).uniform(0, 2, (64, 8, 4, 4)).astype(np.float32)}
    expected = reference(model, feeds)[0]
    converted, (passed, n) = _apply(model, int8_passthrough, pool_to_qlinear)
    assert (passed, n) == (0, 1) and ops(converted) == [
        "QuantizeLinear", "QLinearGlobalAveragePool", *shape_op.split(), "DequantizeLinear"]
    steps = np.abs(run(converted, feeds)[0] - expected) / 0.004
    assert steps.max() <= 1 + 1e-3 and np.median(steps) == 0  # rounded at the input's 0.05: up to 6 steps off


def test_int8_passthrough_maxpool_reshape_relu():
    b = Builder()
    x = b.qdq("x", 0.03, 128)
    y = b.node("MaxPool", [x], kernel_shape=[2, 2], strides=[2, 2])
    y = b.node("Relu", [y])  # zp 128: becomes Max(q, 128)
    y = b.node("Flatten", [y])
    model = b.model([("x", [2, 3, 4, 4])], [y])
    feeds = _x([2, 3, 4, 4])
    expected = reference(model, feeds)[0]
    converted, (n,) = _apply(model, int8_passthrough)
    assert n == 3 and ops(converted) == ["QuantizeLinear", "MaxPool", "Max", "Flatten", "DequantizeLinear"]
    np.testing.assert_array_equal(run(converted, feeds)[0], expected)


@pytest.mark.parametrize("value, moved", [(None, True), (0.0, True), (0.5, False)])
def test_int8_passthrough_pads_zeros_with_the_zero_point(value, moved):
    """Keras's ZeroPadding2D before a max pool (ResNet's stem): a Pad of 0.0 pads the integers with the zero point
    (the integer of 0); any other value stays float."""
    b = Builder()
    pads = b.const(np.array([0, 0, 1, 1, 0, 0, 1, 1], np.int64))
    y = b.node("Pad", [b.qdq("x", 0.03, 128), pads, *([] if value is None else [b.const(np.float32(value))])])
    model = b.model([("x", [2, 3, 4, 4])], [b.node("MaxPool", [y], kernel_shape=[3, 3], strides=[2, 2])])
    feeds = _x([2, 3, 4, 4])
    expected = reference(model, feeds)[0]
    converted, (n,) = _apply(model, int8_passthrough)
    assert n == (2 if moved else 0)
    if moved:
        assert ops(converted) == ["QuantizeLinear", "Pad", "MaxPool", "DequantizeLinear"]
    np.testing.assert_array_equal(run(converted, feeds)[0], expected)


def test_int8_passthrough_splits_and_slices_on_the_integers():
    """A channel split (ShuffleNet's chunk) and a slice move integers: each Split output gets its own DQ."""
    b = Builder()
    x = b.qdq("x", 0.03, 128)
    b.nodes.append(onnx.helper.make_node("Split", [x, b.const(np.array([2, 2], np.int64))], ["a", "c"], axis=1,
                                         name="split"))
    s = b.node("Slice", ["c", b.const(np.array([1], np.int64)), b.const(np.array([3], np.int64)),
                         b.const(np.array([2], np.int64))])
    model = b.model([("x", [2, 4, 4, 4])], ["a", s])
    feeds = _x([2, 4, 4, 4])
    expected = reference(model, feeds)
    converted, (n,) = _apply(model, int8_passthrough)
    # the DQ of the split part the Slice read went with it
    assert n == 2 and ops(converted) == ["QuantizeLinear", "Split", "DequantizeLinear", "Slice", "DequantizeLinear"]
    for got, want in zip(run(converted, feeds), expected):
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("mode, moved", [("nearest", True), ("linear", False)])
def test_int8_passthrough_moves_a_nearest_resize_onto_the_integers(mode, moved):
    """A detector's nearest upsampling (YOLO's neck) selects input values: it runs on the integers, the values the
    same; a linear Resize computes new ones and stays where it is."""
    b = Builder()
    y = b.node("Resize", [b.qdq("x", 0.03, 128), "", b.const(np.array([1, 1, 2, 2], np.float32))], mode=mode)
    model = b.model([("x", [1, 3, 4, 4])], [y])
    feeds = _x([1, 3, 4, 4])
    converted, (n,) = _apply(model, int8_passthrough)
    assert n == int(moved) and (ops(converted).index("Resize") < ops(converted).index("DequantizeLinear")) == moved
    np.testing.assert_array_equal(run(converted, feeds)[0], reference(model, feeds)[0])


def test_int8_passthrough_zero_case():
    b = Builder()
    y = b.node("Sigmoid", [b.qdq("x", 0.03, 128)])
    model = b.model([("x", [1, 4])], [y])
    _, (n,) = _apply(model, int8_passthrough)
    assert n == 0


@pytest.mark.parametrize("scale, zp, high, expected", [
    (6 / 255, 0, 6.0, []),  # a ReLU6 after an op whose range already stops at 6: nothing left
    (0.1, 128, 6.0, ["Max", "Min"]),  # both bounds on the grid: clamps on the integers
    (0.1, 128, 6.05, None),  # 6.05 lies between grid points: the floats would round differently, stays float
])
def test_int8_passthrough_clip(scale, zp, high, expected):
    b = Builder()
    y = b.node("Clip", [b.qdq("x", scale, zp), b.const(np.float32(0)), b.const(np.float32(high))])
    model = b.model([("x", [2, 50])], [y])
    feeds = {"x": np.linspace(-12, 12, 100, dtype=np.float32).reshape(2, 50)}
    expected_out = reference(model, feeds)[0]
    converted, (n,) = _apply(model, int8_passthrough)
    if expected is None:
        assert n == 0 and "Clip" in ops(converted)
        return
    assert n == 1 and "Clip" not in ops(converted) and [o for o in ops(converted) if o in ("Max", "Min")] == expected
    np.testing.assert_array_equal(run(converted, feeds)[0], expected_out)
