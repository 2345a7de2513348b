"""``merge_twin_qdq`` on tiny graphs: its rewrites, the op types after, the numbers in onnxruntime."""

import numpy as np

from recal_onnx.passes.merge_twin_qdq import merge_twin_qdq
from tests.onnx.passes.graphs import _apply, _x
from tests.support.onnx_graphs import Builder, ops, reference, run


def test_merge_twin_qdq_keeps_one_quantizer_per_tensor_and_grid():
    """A Q/DQ pair per reader (quantize_static's ``DedicatedQDQPair``): the twins go, both readers read one pair, the
    values stay; a quantizer on another grid (or with other attributes) is no twin and stays."""
    b = Builder()
    s, z = b.const(np.float32(0.03)), b.const(np.uint8(128))
    twin_s, twin_z = b.const(np.float32(0.03)), b.const(np.uint8(128))  # equal constants under other names
    first = b.node("DequantizeLinear", [b.node("QuantizeLinear", ["x", s, z]), s, z])
    second = b.node("DequantizeLinear", [b.node("QuantizeLinear", ["x", twin_s, twin_z]), twin_s, twin_z])
    other = b.qdq("x", 0.05, 128)
    model = b.model([("x", [2, 4])], [b.node("Add", [first, second]), b.node("Mul", [first, other])])
    feeds = _x([2, 4])
    converted, (n,) = _apply(model, merge_twin_qdq)
    assert n == 2 and ops(converted).count("QuantizeLinear") == 2 and ops(converted).count("DequantizeLinear") == 2
    add = next(node for node in converted.graph.node if node.op_type == "Add")
    assert add.input[0] == add.input[1]
    for got, want in zip(run(converted, feeds), reference(model, feeds)):
        np.testing.assert_array_equal(got, want)
    _, (m,) = _apply(converted, merge_twin_qdq)
    assert m == 0
