"""``matmul_to_nbits`` on tiny graphs: its rewrites, the op types after, the numbers in onnxruntime."""

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from recal_onnx.findings import Findings
from recal_onnx.ir_edits import Graph
from recal_onnx.passes.matmul_to_nbits import matmul_to_nbits
from tests.onnx.passes.graphs import _apply, _weight_only_graph, _x
from tests.support.onnx_graphs import Builder, ops, reference, run


@pytest.mark.parametrize("gemm, group, bits", [(False, 32, 4), (True, 16, 4), (False, 64, 8), (False, 16, 2),
                                               (True, 64, 2)],
                         ids=["matmul-g32-int4", "gemm-g16-int4", "per-channel-int8", "matmul-g16-ternary",
                              "gemm-per-channel-ternary"])
def test_matmul_to_nbits(gemm, group, bits):
    """A weight-only layer becomes one MatMulNBits (its bias Add folded in) with the same values, run by a default
    and an unoptimized session; a MatMul whose input is a dequantized activation (W8A8) is not touched."""

    model = _weight_only_graph(gemm, group, bits=bits)
    feeds = _x([5, 3, 64] if not gemm else [5, 64])
    expected = reference(model, feeds)[0]
    converted, (n,) = _apply(model, matmul_to_nbits)
    assert n == 1 and ops(converted) == ["MatMulNBits"]
    node = converted.graph.node[0]
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    assert attrs["bits"] == bits and attrs["block_size"] == (group if group < 64 else 64) and attrs["N"] == 24
    packed = onnx.numpy_helper.to_array(next(t for t in converted.graph.initializer if t.name == node.input[1]))
    assert packed.shape == (24, 64 // attrs["block_size"], attrs["block_size"] * bits // 8)  # 8 / bits values a byte
    for level in (None, ort.GraphOptimizationLevel.ORT_DISABLE_ALL):
        np.testing.assert_allclose(run(converted, feeds, level=level)[0], expected, rtol=1e-5, atol=1e-5)


def test_matmul_to_nbits_leaves_quantized_inputs_and_odd_groups():

    b = Builder()
    x = b.qdq("x", 0.05, 128)
    y = b.node("MatMul", [x, b.weight([16, 8], axis=1)])
    _, (n,) = _apply(b.model([("x", [2, 16])], [y]), matmul_to_nbits)
    assert n == 0
    findings = Findings()
    g = Graph(onnx.shape_inference.infer_shapes(_weight_only_graph(False, 8, k=64)))  # groups of 8: no block size
    assert matmul_to_nbits(g, findings=findings) == 0 and list(findings.kept_float.values())[0][0] == "MatMul"
