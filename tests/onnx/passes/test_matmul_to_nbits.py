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


def test_matmul_to_nbits_says_where_pruned_channels_stay():
    """A weight-only layer whose weight holds 16 or more all-zero output channels (pruned, not thinned) is noted,
    with what to do; one with a few zero rows is not."""
    for dead, said in ((16, True), (3, False)):
        findings = Findings()
        g = Graph(onnx.shape_inference.infer_shapes(_weight_only_graph(False, 32, dead_rows=dead)))
        assert matmul_to_nbits(g, findings=findings) == 1
        notes = " ".join(findings.notes)
        assert ("16 of 24 outputs" in notes and "recal_torch.thin" in notes) == said, notes


def test_matmul_to_nbits_notes_the_slow_widths_at_accuracy_level_0():
    """2- and 8-bit MatMulNBits at accuracy_level 0 are noted (onnxruntime runs them far slower than 4 bits on the
    CPUs measured); 4 bits, or accuracy_level 4, are not."""
    for bits, level, said in ((2, 0, True), (8, 0, True), (4, 0, False), (2, 4, False)):
        findings = Findings()
        g = Graph(onnx.shape_inference.infer_shapes(_weight_only_graph(False, 32, bits=bits)))
        assert matmul_to_nbits(g, level, findings=findings) == 1
        assert ("at 2 or 8 bits with accuracy_level 0" in " ".join(findings.notes)) == said, (bits, level)
