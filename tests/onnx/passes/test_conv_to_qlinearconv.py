"""``conv_to_qlinearconv`` on tiny graphs: its rewrites, the op types after, the numbers in onnxruntime."""

import numpy as np
import onnx
import pytest

from recal_onnx.ir_edits import Graph
from recal_onnx.passes.conv_to_qlinearconv import conv_to_qlinearconv
from tests.onnx.passes.graphs import _apply, _conv_graph, _x
from tests.support.onnx_graphs import Builder, ops, reference, run


@pytest.mark.parametrize("relu, out_zp", [(False, 100), (True, 0), (True, 40)])
def test_conv_to_qlinearconv(relu, out_zp):
    model = _conv_graph(relu=relu, out_zp=out_zp)
    feeds = _x([2, 3, 6, 6])
    expected = reference(model, feeds)[0]
    converted, (n,) = _apply(model, conv_to_qlinearconv)
    assert n == 1
    assert "QLinearConv" in ops(converted) and "Conv" not in ops(converted) and "Relu" not in ops(converted)
    assert ("Max" in ops(converted)) == (relu and out_zp != 0)
    got = run(converted, feeds)[0]
    assert np.abs(got - expected).max() <= 0.02 + 1e-6  # at most one output quantum (bias rounding)


def test_conv_to_qlinearconv_zero_rewrites_for_a_float_weight():
    b = Builder()
    y = b.node("Conv", [b.qdq("x", 0.03, 128), b.const(np.ones((2, 3, 1, 1), np.float32))])
    model = b.model([("x", [1, 3, 4, 4])], [b.qdq(y, 0.1, 0)])
    _, (n,) = _apply(model, conv_to_qlinearconv)
    assert n == 0


@pytest.mark.parametrize("out_scale, out_zp, clamps", [(0.04, 40, ["Max", "Min"]), (0.04, 0, ["Min"]),
                                                       (0.02, 0, [])])  # 6 is beyond 255 steps
def test_relu6_after_a_conv_folds_into_its_integers(out_scale, out_zp, clamps):
    """Conv -> Clip(0, 6) -> Q: the clamp becomes Max / Min on the integers only where the output type's own
    range does not already do it, and the result equals the QDQ model's (monotone rounding: exact)."""
    def relu6(b, y):
        return b.node("Clip", [y, b.const(np.float32(0.0)), b.const(np.float32(6.0))])

    model = _conv_graph(extra=relu6)
    quantize = next(n for n in model.graph.node if n.op_type == "QuantizeLinear" and n.input[0].startswith("clip"))
    inits = {i.name: i for i in model.graph.initializer}
    inits[quantize.input[1]].CopyFrom(onnx.numpy_helper.from_array(np.float32(out_scale), quantize.input[1]))
    inits[quantize.input[2]].CopyFrom(onnx.numpy_helper.from_array(np.uint8(out_zp), quantize.input[2]))
    feeds = {"x": _x([2, 3, 6, 6])["x"] * 4}  # conv outputs well past 6 and below 0
    expected = reference(model, feeds)[0]
    top = min(6.0, (255 - out_zp) * out_scale)
    assert expected.max() == pytest.approx(top, abs=out_scale) and expected.min() == pytest.approx(0, abs=out_scale)
    converted, (n,) = _apply(model, conv_to_qlinearconv)
    assert n == 1 and "Clip" not in ops(converted)
    assert [op for op in ops(converted) if op in ("Max", "Min")] == clamps
    assert np.abs(run(converted, feeds)[0] - expected).max() <= out_scale + 1e-6  # the conv's own rounding


def test_conv_with_per_tensor_weight_scale():
    b = Builder()
    y = b.node("Conv", [b.qdq("x", 0.03, 128), b.weight((4, 3, 3, 3), per_channel=False)], pads=[1, 1, 1, 1])
    model = b.model([("x", [1, 3, 5, 5])], [b.qdq(y, 0.05, 120)])
    feeds = _x([1, 3, 5, 5])
    expected = reference(model, feeds)[0]
    converted, (n,) = _apply(model, conv_to_qlinearconv)
    assert n == 1 and np.abs(run(converted, feeds)[0] - expected).max() <= 0.05 + 1e-6


def test_the_graph_layer_keeps_names_and_leaves_the_input_model_alone():
    """A node standing in for another keeps the replaced tensor's name (verification compares tensors by name),
    a graph output keeps its name when its producer goes, dead nodes go, and the input ModelProto is untouched."""
    model = _conv_graph(relu=True, out_zp=0)
    before = model.SerializeToString()
    g = Graph(onnx.shape_inference.infer_shapes(model))
    q = next(n for n in g.each("QuantizeLinear") if getattr(g.producer(n.inputs[0]), "op_type", "") == "Relu")
    name = q.outputs[0].name
    assert conv_to_qlinearconv(g) == 1
    (conv,) = g.each("QLinearConv")
    assert conv.outputs[0].name == name and g.rank(conv.outputs[0]) == 4
    output = g.graph.outputs[0]
    dq = g.producer(output)
    relu = g.add_node("Relu", [dq.inputs[0]], name="stand_in", replaces=output)
    assert g.graph.outputs[0] is relu.outputs[0] and relu.outputs[0].name == model.graph.output[0].name
    assert g.uses(dq.outputs[0]) == 0
    assert g.remove_dead() == 3  # that DequantizeLinear, and the input's and weight's the QLinearConv no longer reads
    written = g.commit()
    onnx.checker.check_model(written)
    assert [o.name for o in written.graph.output] == [o.name for o in model.graph.output]
    assert model.SerializeToString() == before
