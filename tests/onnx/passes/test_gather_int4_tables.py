"""``gather_int4_tables`` on tiny graphs: its rewrites, the op types after, the numbers in onnxruntime."""


import numpy as np
import onnx
import onnxruntime as ort
import pytest

from tests.onnx.passes.graphs import _apply
from tests.support.onnx_graphs import Builder, ops, reference, run


@pytest.mark.parametrize("group", [16, 48], ids=["groups-of-16", "per-row"])
def test_gather_int4_tables(group):
    """An int4 table (recal's grouped rows, or one scale a row) is gathered packed by GatherBlockQuantized, the same
    rows; an int8 table is left to the int8 gather."""
    from recal_onnx.passes.gather_int4_tables import gather_int4_tables

    for levels, expected in ((7, 1), (127, 0)):
        b = Builder()
        vocab, width = 10, 48
        q = b.rng.integers(-levels, levels + 1, (vocab * width // group, group)).astype(np.int8)
        scale = b.rng.uniform(0.01, 0.05, q.shape[0]).astype(np.float32)
        dq = b.node("DequantizeLinear", [b.const(q, "w"), b.const(scale, "ws"),
                                         b.const(np.zeros(scale.size, np.int8))], axis=0)
        table = b.node("Reshape", [dq, b.const(np.array([vocab, width], np.int64))])
        y = b.node("Gather", [table, "ids"], axis=0)
        graph = onnx.helper.make_graph(b.nodes, "t", [onnx.helper.make_tensor_value_info("ids", onnx.TensorProto.INT64,
                                                                                          [2, 3])],
                                       [onnx.helper.make_tensor_value_info(y, onnx.TensorProto.FLOAT, None)], b.inits)
        model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 17)])
        feeds = {"ids": np.array([[0, 9, 3], [3, 3, 1]], np.int64)}
        want = reference(model, feeds)[0]
        converted, (n,) = _apply(model, gather_int4_tables)
        assert n == expected
        if expected:
            assert ops(converted) == ["GatherBlockQuantized"]
            for level in (None, ort.GraphOptimizationLevel.ORT_DISABLE_ALL):
                np.testing.assert_array_equal(run(converted, feeds, level=level)[0], want)
