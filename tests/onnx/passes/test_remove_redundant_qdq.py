"""``remove_redundant_qdq`` on tiny graphs: its rewrites, the op types after, the numbers in onnxruntime."""

import numpy as np

from recal_onnx.passes.remove_redundant_qdq import remove_redundant_qdq
from tests.onnx.passes.graphs import _apply
from tests.support.onnx_graphs import Builder, ops


def test_remove_redundant_qdq():
    b = Builder()
    s, z = b.const(np.float32(0.03)), b.const(np.uint8(128))
    q1 = b.node("QuantizeLinear", ["x", s, z])
    q2 = b.node("QuantizeLinear", [b.node("DequantizeLinear", [q1, s, z]), s, z])
    model = b.model([("x", [1, 4])], [b.node("DequantizeLinear", [q2, s, z])])
    converted, (n,) = _apply(model, remove_redundant_qdq)
    assert n == 1 and ops(converted) == ["QuantizeLinear", "DequantizeLinear"]
    _, (m,) = _apply(converted, remove_redundant_qdq)
    assert m == 0
