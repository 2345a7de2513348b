"""``bias_apart`` on tiny graphs: its rewrites, the op types after, the numbers in onnxruntime."""

import numpy as np
import onnx

from recal_onnx.findings import Findings
from recal_onnx.ir_edits import Graph
from recal_onnx.passes.bias_apart import bias_apart
from tests.onnx.passes.graphs import _conv_graph, _x
from tests.support.onnx_graphs import ops, reference


def test_bias_apart():
    """A conv the converter left float for its bias (``findings.kept_float``) adds the bias in an Add of its own, the
    same numbers; a conv not recorded there keeps its bias."""
    model = _conv_graph()
    feeds = _x([2, 3, 6, 6])
    g = Graph(onnx.shape_inference.infer_shapes(model))
    conv = next(n for n in g.nodes if n.op_type == "Conv")
    findings = Findings()
    assert bias_apart(g, findings) == 0
    findings.kept_float[conv.name] = ("Conv", "its bias is beyond int32")
    assert bias_apart(g, findings) == 1 and len(conv.inputs) == 2
    apart = g.commit()
    assert ops(apart).count("Add") == 1 and ops(apart).index("Conv") < ops(apart).index("Add")
    np.testing.assert_allclose(reference(apart, feeds)[0], reference(model, feeds)[0], atol=1e-6)
