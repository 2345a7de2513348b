"""``finer_weight_grids`` on tiny graphs: its rewrites, the op types after, the numbers in onnxruntime."""

import numpy as np
import onnx
import pytest

from recal_onnx.passes.finer_weight_grids import finer_weight_grids
from tests.onnx.passes.graphs import _apply, _x
from tests.support.onnx_graphs import Builder, reference, run


@pytest.mark.parametrize("largest, factor", [(8, 8), (30, 2), (100, 1)])
def test_finer_weight_grids_puts_a_small_weight_on_a_finer_grid_for_its_bias(largest, factor):
    """A conv with 4-bit-range weights and a float bias between its int32 steps (a BatchNorm folded in): the weights
    times the largest power of two that keeps them within +-64, the scale divided by it (the same values bit for bit),
    so the bias rounds on a grid as much finer; weights beyond +-32 stay as they are."""
    b = Builder()
    q = np.clip(b.rng.integers(-largest, largest + 1, (4, 3, 3, 3)), -127, 127).astype(np.int8)
    q[0, 0, 0, 0] = largest
    scale = np.array([0.02, 0.03, 0.025, 0.05], np.float32)
    w = b.node("DequantizeLinear", [b.const(q), b.const(scale), b.const(np.zeros(4, np.int8))], axis=0)
    y = b.node("Conv", [b.qdq("x", 0.03, 128), w, b.const(np.array([0.0131, -0.2, 0.05, 0.3], np.float32))],
               pads=[1, 1, 1, 1])
    model = b.model([("x", [1, 3, 5, 5])], [y])
    feeds = _x([1, 3, 5, 5])
    converted, (n,) = _apply(model, finer_weight_grids)
    assert n == (factor > 1)
    weights = [onnx.numpy_helper.to_array(t) for t in converted.graph.initializer if t.data_type == onnx.TensorProto.INT8
               and t.dims == [4, 3, 3, 3]]
    assert len(weights) == 1 and np.array_equal(weights[0], q * factor) and np.abs(weights[0]).max() <= 64 or n == 0
    np.testing.assert_array_equal(run(converted, feeds)[0], reference(model, feeds)[0])
