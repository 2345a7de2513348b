"""``unary_to_table`` on tiny graphs: its rewrites, the op types after, the numbers in onnxruntime."""

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from recal_onnx.findings import Findings
from recal_onnx.ir_edits import Graph
from recal_onnx.passes.unary_to_table import unary_to_table
from tests.onnx.passes.graphs import _apply
from tests.support.onnx_graphs import Builder, ops, reference, run


@pytest.mark.parametrize("form", ["hard-swish ops", "HardSwish", "hard-sigmoid, int8", "padded", "nodes unsorted",
                                  "read elsewhere", "per channel", "two inputs", "sigmoid alone", "feature map"])
def test_unary_to_table(form):
    """A function of one quantized tensor computed in float before a QuantizeLinear (MobileNetV3's hard-swish as
    Keras's TF export writes it, as ONNX's HardSwish, hard-sigmoid on an int8 grid) becomes a 256-entry table
    looked up with Gather, equal to the float model on every value. Not when a value inside is read elsewhere,
    a constant is per channel, the ops read two quantized tensors, or it is a sigmoid alone (QLinearSigmoid's).
    A zero padding before the QuantizeLinear (ZeroPadding2D's) moves after the table, padding with its zero point.
    The table is right when earlier rewrites left the graph's nodes out of computing order. A feature map (over
    TABLE_MAX values a sample), where onnxruntime's float ops are faster than its lookup, stays float, named."""
    b = Builder()
    dtype, zp = (np.int8, -5) if "int8" in form else (np.uint8, 120)
    x = b.qdq("x", 0.05, zp, dtype)
    c = b.const
    if form == "HardSwish":
        y = b.node("HardSwish", [x])
    elif form == "sigmoid alone":
        y = b.node("Sigmoid", [x])
    elif form == "two inputs":
        y = b.node("Mul", [x, b.qdq("z", 0.02, 128)])
    else:
        three = c(np.array([3.0] if form != "per channel" else [[[3.0]], [[2.0]], [[1.0]]], np.float32))
        gate = b.node("Div", [b.node("Clip", [b.node("Add", [x, three]), c(np.float32(0)), c(np.float32(6))]),
                              c(np.float32(6))])
        y = gate if "hard-sigmoid" in form else b.node("Mul", [x, gate])
    if form == "padded":
        y = b.node("Pad", [y, c(np.array([0, 0, 1, 1, 0, 0, 1, 1], np.int64))])
    outputs = [b.qdq(y, 0.02, 3)] + ([gate] if form == "read elsewhere" else [])
    shape = [2, 3, 32, 32] if form == "feature map" else [2, 3, 4, 4]
    inputs = [("x", shape)] + ([("z", shape)] if form == "two inputs" else [])
    model = b.model(inputs, outputs)
    rng = np.random.default_rng(0)
    feeds = {name: (rng.standard_normal(shape) * 4).astype(np.float32) for name, _ in inputs}
    expected = reference(model, feeds)
    if form == "nodes unsorted":  # as a Graph holds them after rewrites (a valid model file cannot)
        g = Graph(onnx.shape_inference.infer_shapes(model))
        g.graph.sort()
        nodes = list(g.graph)
        g.graph.remove(nodes)
        g.graph.extend(nodes[::-1])
        n = unary_to_table(g)
        converted = g.commit()
    else:
        findings = Findings()
        converted, (n,) = _apply(model, unary_to_table, findings=findings)
        assert (form == "feature map") == bool(findings.kept_float)
        assert all("3072 values a sample" in why for _, why in findings.kept_float.values())
    converts = form in ("hard-swish ops", "HardSwish", "hard-sigmoid, int8", "padded", "nodes unsorted")
    assert n == int(converts)
    if converts:
        assert "Gather" in ops(converted) and not {"Add", "Clip", "Div", "Mul", "HardSwish"} & set(ops(converted))
        for level in (ort.GraphOptimizationLevel.ORT_ENABLE_ALL, ort.GraphOptimizationLevel.ORT_DISABLE_ALL):
            np.testing.assert_array_equal(run(converted, feeds, level=level)[0], expected[0])
    else:
        assert ops(converted) == ops(model)
