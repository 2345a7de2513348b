"""``fusible_qdq_pools`` on tiny graphs: its rewrites, the op types after, the numbers in onnxruntime."""

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from recal_onnx.passes.fusible_qdq_pools import fusible_qdq_pools
from tests.onnx.passes.graphs import _apply, _x
from tests.support.onnx_graphs import Builder, ops, reference, run


@pytest.mark.parametrize("pool, rewritten", [("ReduceMean", True), ("channel mean", False),
                                             ("GlobalAveragePool", False), ("GlobalAveragePool -> Flatten", True)])
def test_qdq_pools_are_written_as_onnxruntime_fuses_them(pool, rewritten, tmp_path):
    """The dynamo exporter's global pool (``DQ -> ReduceMean(2, 3) -> Q``) and a pool flattened before its Q
    both run in float under onnxruntime's QDQ fusion; rewritten, each is QLinearGlobalAveragePool, the numbers the
    same. A mean over the channels is no pool; ``DQ -> GlobalAveragePool -> Q`` is fused already."""
    b = Builder()
    x = b.qdq("x", 0.0297, 128)
    if pool == "ReduceMean" or pool == "channel mean":
        y = b.node("ReduceMean", [x], axes=[2, 3] if pool == "ReduceMean" else [1], keepdims=1)
    else:
        y = b.node("GlobalAveragePool", [x])
    if pool.endswith("Flatten"):
        y = b.node("Flatten", [y])
    model = b.model([("x", [2, 3, 4, 4])], [b.qdq(y, 0.0113, 128)])
    feeds = _x([2, 3, 4, 4])
    expected = reference(model, feeds)[0]
    converted, (n,) = _apply(model, fusible_qdq_pools)
    assert n == rewritten and ("ReduceMean" in ops(converted)) == (pool == "channel mean")
    options = ort.SessionOptions()
    options.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    ort.InferenceSession(converted.SerializeToString(), options, providers=["CPUExecutionProvider"])
    assert ("QLinearGlobalAveragePool" in ops(onnx.load(tmp_path / "optimized.onnx"))) == (pool != "channel mean")
    np.testing.assert_array_equal(run(converted, feeds)[0], expected)
