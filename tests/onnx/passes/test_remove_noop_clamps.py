"""``remove_noop_clamps`` on tiny graphs: its rewrites, the op types after, the numbers in onnxruntime."""

import numpy as np
import pytest

from recal_onnx.passes.remove_noop_clamps import remove_noop_clamps
from tests.onnx.passes.graphs import _apply
from tests.support.onnx_graphs import Builder, ops, reference, run


@pytest.mark.parametrize("zp, clip_max, removed", [(0, None, True), (128, None, False), (0, 6.0, True),
                                                   (0, 2.0, False)])
def test_remove_noop_clamps(zp, clip_max, removed):
    b = Builder()
    x = b.qdq("x", 6.0 / 255, zp)  # ReLU6's grid: 0 .. 6
    act = b.node("Relu", [x]) if clip_max is None else b.node("Clip", [x, b.const(np.float32(0)),
                                                                       b.const(np.float32(clip_max))])
    y = b.qdq(b.node("Conv", [act, b.weight([4, 3, 1, 1])]), 0.1, 128)
    model = b.model([("x", [1, 3, 4, 4])], [y])
    feeds = {"x": np.linspace(-8, 8, 48, dtype=np.float32).reshape(1, 3, 4, 4)}
    expected = reference(model, feeds)[0]
    converted, (n,) = _apply(model, remove_noop_clamps)
    assert n == removed and (("Relu" in ops(converted)) or ("Clip" in ops(converted))) != removed
    np.testing.assert_array_equal(run(converted, feeds)[0], expected)
