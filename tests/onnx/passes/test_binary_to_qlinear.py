"""``binary_to_qlinear`` on tiny graphs: its rewrites, the op types after, the numbers in onnxruntime."""

import numpy as np

from recal_onnx.passes.binary_to_qlinear import binary_to_qlinear
from tests.onnx.passes.graphs import _apply, _x
from tests.support.onnx_graphs import Builder, ops, reference, run


def test_add_to_qlinearadd_and_zero_case():
    b = Builder()
    y = b.node("Add", [b.qdq("x", 0.03, 128), b.qdq("x", 0.05, 100)])
    model = b.model([("x", [2, 4, 3, 3])], [b.qdq(b.node("Relu", [y]), 0.06, 10)])
    feeds = _x([2, 4, 3, 3])
    expected = reference(model, feeds)[0]
    converted, (n,) = _apply(model, binary_to_qlinear)
    assert n == 1 and ops(converted).count("QLinearAdd") == 1 and "Max" in ops(converted)
    assert np.abs(run(converted, feeds)[0] - expected).max() <= 0.06 + 1e-6

    b = Builder()
    y = b.node("Add", [b.qdq("x", 0.03, 128), b.node("Relu", ["x"])])  # one input is float
    model = b.model([("x", [1, 2])], [b.qdq(y, 0.06, 10)])
    _, (n,) = _apply(model, binary_to_qlinear)
    assert n == 0


def test_a_quantized_constant_beside_an_activation_becomes_a_qlinear_operand():
    """``Add(DQ(x), DQ(bias [C] int8))`` (quantize_static's bias after a MatMul) and ``Mul(DQ(x), DQ(scalar))`` (an
    attention's scale): QLinearAdd / QLinearMul with the constant's integers moved to uint8 and given x's rank."""
    b = Builder()
    x = b.qdq("x", 0.03, 128)
    bias = b.node("DequantizeLinear", [b.const(np.arange(-8, 8, dtype=np.int8) * 9, "bq"), b.const(np.float32(0.01)),
                                       b.const(np.int8(0))])
    y = b.qdq(b.node("Add", [x, bias]), 0.04, 120)
    scale = b.node("DequantizeLinear", [b.const(np.uint8(200)), b.const(np.float32(0.005)), b.const(np.uint8(0))])
    model = b.model([("x", [2, 5, 16])], [b.qdq(b.node("Mul", [y, scale]), 0.04, 128)])
    feeds = _x([2, 5, 16])
    converted, (n,) = _apply(model, binary_to_qlinear)
    assert n == 2 and {"QLinearAdd", "QLinearMul"} <= set(ops(converted)) and not {"Add", "Mul"} & set(ops(converted))
    assert np.abs(run(converted, feeds)[0] - reference(model, feeds)[0]).max() <= 0.04 + 1e-6
