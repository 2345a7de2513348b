"""``inputs_to_constants`` on tiny graphs: its rewrites, the op types after, the numbers in onnxruntime."""

import numpy as np
import onnx

from recal_onnx.findings import Findings
from recal_onnx.passes.inputs_to_constants import inputs_to_constants
from tests.onnx.passes.graphs import _apply, _x
from tests.support.onnx_graphs import Builder, reference, run


def test_inputs_to_constants_holds_initializers_listed_as_inputs_as_constants_only():
    """torch.onnx's ``keep_initializers_as_inputs`` (Brevitas exports so): an initializer also listed as a graph
    input is a constant of the converted model, as the converter read it, and the note says so; the real input
    stays, and the model computes the same."""
    b = Builder()
    gamma = b.const(np.full(4, 1.5, np.float32), "gamma")
    model = b.model([("x", [2, 4])], [b.node("Mul", [b.qdq("x", 0.03, 128), gamma])])
    model.graph.input.append(onnx.helper.make_tensor_value_info(gamma, onnx.TensorProto.FLOAT, [4]))
    findings = Findings()
    converted, (n,) = _apply(model, inputs_to_constants, findings=findings)
    assert n == 1 and [i.name for i in converted.graph.input] == ["x"]
    assert "1 initializers the file also listed as graph inputs" in findings.notes[0]
    feeds = _x([2, 4])
    np.testing.assert_array_equal(run(converted, feeds)[0], reference(model, feeds)[0])
