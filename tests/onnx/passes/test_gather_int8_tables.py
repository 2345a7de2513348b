"""``gather_int8_tables`` on tiny graphs: its rewrites, the op types after, the numbers in onnxruntime."""

import numpy as np
import onnx
import pytest

from recal_onnx.passes.gather_int8_tables import gather_int8_tables
from tests.onnx.passes.graphs import _apply
from tests.support.onnx_graphs import Builder, reference, run


@pytest.mark.parametrize("axis, per_channel", [(0, True), (1, True), (0, False)])
def test_gather_int8_tables_gathers_integer_rows(axis, per_channel):
    b = Builder()
    table = b.weight((50, 6), axis=axis, per_channel=per_channel)
    y = b.node("Gather", [table, "ids"], axis=0)
    graph_inputs = [onnx.helper.make_tensor_value_info("ids", onnx.TensorProto.INT64, [2, 5])]
    model = b.model([], [y])
    model.graph.input.extend(graph_inputs)
    feeds = {"ids": np.random.default_rng(0).integers(0, 50, (2, 5))}
    expected = reference(model, feeds)[0]
    converted, (n,) = _apply(model, gather_int8_tables)
    assert n == 1
    gathers = [x for x in converted.graph.node if x.op_type == "Gather"]
    int8_tables = {t.name for t in converted.graph.initializer if t.data_type == onnx.TensorProto.INT8}
    assert gathers[0].input[0] in int8_tables  # the integer table is read, no float copy exists
    assert not [t for t in converted.graph.initializer if t.data_type == onnx.TensorProto.FLOAT and t.dims[:1] == [50]
                and len(t.dims) == 2 and t.dims[1] == 6]
    np.testing.assert_array_equal(run(converted, feeds)[0], expected)


def test_gather_int8_tables_zero_case_a_gather_along_another_axis():
    b = Builder()
    y = b.node("Gather", [b.weight((50, 6)), b.const(np.array([0, 2]))], axis=1)
    model = b.model([], [y])
    assert _apply(model, gather_int8_tables)[1] == [0]
