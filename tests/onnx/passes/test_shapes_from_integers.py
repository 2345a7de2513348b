"""``shapes_from_integers`` on tiny graphs: its rewrites, the op types after, the numbers in onnxruntime."""


import onnx

from tests.onnx.passes.graphs import _apply, _x
from tests.support.onnx_graphs import Builder, ops, reference, run


def test_a_shape_of_a_dequantized_tensor_reads_its_integers():
    """ShuffleNet's ``x.size()``: a DequantizeLinear read only by a Shape is not computed; the shape is the same."""
    from recal_onnx.passes.shapes_from_integers import shapes_from_integers

    b = Builder()
    x = b.qdq("x", 0.05, 128)
    shape = b.node("Shape", [x])
    model = b.model([("x", ["n", 4, 3, 3])], [shape])
    model.graph.output[0].type.tensor_type.elem_type = onnx.TensorProto.INT64
    converted, (n,) = _apply(model, shapes_from_integers)
    assert n == 1 and "DequantizeLinear" not in ops(converted), ops(converted)
    feeds = _x([2, 4, 3, 3])
    assert run(converted, feeds)[0].tolist() == reference(model, feeds)[0].tolist() == [2, 4, 3, 3]
