"""``minmax_to_clip`` on tiny graphs: its rewrites, the op types after, the numbers in onnxruntime."""

import numpy as np
import pytest

from recal_onnx.passes.conv_to_qlinearconv import conv_to_qlinearconv
from recal_onnx.passes.minmax_to_clip import minmax_to_clip
from tests.onnx.passes.graphs import _apply
from tests.support.onnx_graphs import Builder, ops, reference, run


@pytest.mark.parametrize("form", ["max-min", "min-max", "max", "min", "scalar-first", "crossed"])
def test_minmax_to_clip(form):
    """jax2onnx's ReLU6 (``Max(x, 0) -> Min(., 6)``) and ReLU (``Max(x, 0)``) become the Clip the integer passes fold
    into a conv, in either order and with the constant on either side; bounds that cross (min > max) are two
    one-sided Clips."""
    b = Builder()
    x = b.qdq("x", 0.05, 128)
    y = b.node("Conv", [x, b.weight((4, 3, 1, 1))])
    zero, six = b.const(np.array(0.0, np.float32), "zero"), b.const(np.array([6.0], np.float32), "six")
    if form in ("max-min", "crossed"):
        y = b.node("Min", [b.node("Max", [y, six if form == "crossed" else zero]), zero if form == "crossed" else six])
    elif form == "min-max":
        y = b.node("Max", [b.node("Min", [y, six]), zero])
    elif form == "scalar-first":
        y = b.node("Max", [zero, y])
    else:
        y = b.node(form.capitalize(), [y, zero if form == "max" else six])
    model = b.model([("x", [1, 3, 4, 4])], [b.qdq(y, 0.03, 0)])
    feeds = {"x": np.random.default_rng(0).standard_normal((1, 3, 4, 4)).astype(np.float32) * 8}
    expected = reference(model, feeds)[0]
    converted, (n,) = _apply(model, minmax_to_clip)
    assert n == (2 if form == "crossed" else 1)
    assert "Max" not in ops(converted) and "Min" not in ops(converted) and ops(converted).count("Clip") == n
    np.testing.assert_array_equal(run(converted, feeds)[0], expected)
    if form == "max-min":  # and the ReLU6 tail folds into the integer conv
        integer, _ = _apply(converted, conv_to_qlinearconv)
        assert "Clip" not in ops(integer) and "QLinearConv" in ops(integer)
        assert np.abs(run(integer, feeds)[0] - expected).max() <= 0.03 + 1e-6
