"""``concat_to_qlinear`` on tiny graphs: its rewrites, the op types after, the numbers in onnxruntime."""

import numpy as np
import pytest

from recal_onnx.passes.concat_to_qlinear import concat_to_qlinear
from tests.onnx.passes.graphs import _apply
from tests.support.onnx_graphs import Builder, ops, reference, run


@pytest.mark.parametrize("scales, zp, expected_op", [((0.05, 0.05), 128, "Concat"), ((0.03, 0.08), 0, "QLinearConcat"),
                                                     ((0.05, 0.05), 0, "QLinearConcat")])
def test_concat_to_qlinear(scales, zp, expected_op):
    b = Builder()
    x = b.qdq("x", scales[0], 128)
    y = b.qdq(b.node("Relu", ["x"]), scales[1], zp)
    out = b.qdq(b.node("Concat", [x, y], axis=1), 0.05, 128)
    model = b.model([("x", [2, 3, 4])], [out])
    feeds = {"x": np.linspace(-4, 4, 24, dtype=np.float32).reshape(2, 3, 4)}
    expected = reference(model, feeds)[0]
    converted, (n,) = _apply(model, concat_to_qlinear)
    assert n == 1 and expected_op in ops(converted) and ops(converted).count("Concat") == (expected_op == "Concat")
    np.testing.assert_allclose(run(converted, feeds)[0], expected, atol=0.05 * 1.0001)  # at most one output step
    if expected_op == "Concat":
        np.testing.assert_array_equal(run(converted, feeds)[0], expected)


def test_concat_to_qlinear_zero_case_a_float_input():
    b = Builder()
    out = b.qdq(b.node("Concat", [b.qdq("x", 0.05, 128), "x"], axis=1), 0.05, 128)
    model = b.model([("x", [2, 3])], [out])
    assert _apply(model, concat_to_qlinear)[1] == [0]
