"""``fold_constants`` on tiny graphs: its rewrites, the op types after, the numbers in onnxruntime."""

import numpy as np

from recal_onnx.ir_edits import Graph
from recal_onnx.passes.constants_to_initializers import constants_to_initializers
from recal_onnx.passes.fold_constants import fold_constants
from recal_onnx.passes.remove_identities import remove_identities
from tests.onnx.passes.graphs import _apply, _x
from tests.support.onnx_graphs import Builder, ops, reference, run


def test_fold_constants_turns_weight_quantize_into_int8():
    b = Builder()
    w = b.node("Mul", [b.const(np.full((2, 3, 1, 1), 0.5, np.float32)), b.const(np.float32(2.0))])
    s, z = b.const(np.float32(0.01)), b.const(np.int8(0))
    wq = b.node("DequantizeLinear", [b.node("QuantizeLinear", [w, s, z]), s, z])
    y = b.node("Conv", [b.qdq("x", 0.05, 128), b.node("Identity", [wq])])
    model = b.model([("x", [1, 3, 2, 2])], [y])
    folded, counts = _apply(model, constants_to_initializers, remove_identities, fold_constants)
    assert counts[1] == 1 and counts[2] == 2
    assert ops(folded).count("QuantizeLinear") == 1  # only the activation's
    _, again = _apply(folded, fold_constants)
    assert again == [0]


def test_fold_constants_requantizes_a_dequantized_constant():
    """``QuantizeLinear(DequantizeLinear(c))`` (quantize_static requantizing a bias torch's exporter shared with a
    LayerNorm) folds to its integers; the DequantizeLinear itself stays (a weight's pattern)."""
    b = Builder()
    shared = b.node("DequantizeLinear", [b.const(np.array([3, -5, 7], np.int8)), b.const(np.float32(0.1))])
    requantized = b.node("QuantizeLinear", [shared, b.const(np.float32(0.05)), b.const(np.uint8(100))])
    model = b.model([("x", [1, 3])], [b.node("Add", ["x", b.node("DequantizeLinear", [requantized, b.const(
        np.float32(0.05)), b.const(np.uint8(100))])]), b.node("Mul", ["x", shared])])
    g = Graph(model)
    assert fold_constants(g) == 1
    assert [n.op_type for n in g.nodes].count("QuantizeLinear") == 0
    feeds = _x([1, 3])
    for got, expected in zip(run(g.commit(), feeds), reference(model, feeds)):
        np.testing.assert_array_equal(got, expected)
