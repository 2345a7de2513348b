"""``standard_qdq`` on tiny graphs: its rewrites, the op types after, the numbers in onnxruntime."""

import numpy as np
import onnx

from recal_onnx.ir_edits import Graph
from recal_onnx.passes.standard_qdq import standard_qdq
from tests.onnx.passes.graphs import _opset21, _x
from tests.support.onnx_graphs import reference, run


def test_standard_qdq_reads_onnxruntimes_own_qdq_where_the_opset_defines_it():
    """``com.microsoft`` Q/DQ of uint8 become the default domain's (their arithmetic is the same); uint16 ones stay."""
    h = onnx.helper
    inits = [onnx.numpy_helper.from_array(np.float32(0.03), "s"), onnx.numpy_helper.from_array(np.uint8(128), "z"),
             onnx.numpy_helper.from_array(np.uint16(30000), "z16")]
    nodes = [h.make_node("QuantizeLinear", ["x", "s", "z"], ["q"], domain="com.microsoft"),
             h.make_node("DequantizeLinear", ["q", "s", "z"], ["f"], domain="com.microsoft"),
             h.make_node("QuantizeLinear", ["f", "s", "z16"], ["q16"], domain="com.microsoft"),
             h.make_node("DequantizeLinear", ["q16", "s", "z16"], ["out"], domain="com.microsoft")]
    model = _opset21(nodes, [("x", [2, 8])], ["out"], inits, domain="com.microsoft")
    g = Graph(model)
    assert standard_qdq(g) == 2
    assert [n.domain for n in g.nodes] == ["", "", "com.microsoft", "com.microsoft"]
    feeds = _x([2, 8])
    np.testing.assert_array_equal(run(g.commit(), feeds)[0], reference(model, feeds)[0])
