"""``sigmoid_to_qlinear`` on tiny graphs: its rewrites, the op types after, the numbers in onnxruntime."""

from recal_onnx.passes.sigmoid_to_qlinear import sigmoid_to_qlinear
from tests.onnx.passes.graphs import _apply
from tests.support.onnx_graphs import Builder


def test_a_sigmoid_without_a_quantized_output_stays_float():
    b = Builder()
    model = b.model([("x", [1, 4])], [b.node("Sigmoid", [b.qdq("x", 0.03, 128)])])
    _, (n,) = _apply(model, sigmoid_to_qlinear)
    assert n == 0
