"""``weights_from_grids`` on tiny graphs: its rewrites, the op types after, the numbers in onnxruntime."""

import warnings

import numpy as np
import onnx
import pytest

from recal_onnx import quantize_qat_export
from recal_onnx.findings import Findings
from recal_onnx.passes.weights_from_grids import grid_of, weights_from_grids
from tests.onnx.passes.graphs import _apply, _folded_weight_graph
from tests.support.onnx_graphs import ops


@pytest.mark.parametrize("op, channels_last", [("Conv", False), ("Conv", True), ("Gemm", False), ("MatMul", False)])
def test_weights_from_grids_reads_a_folded_weight_as_the_int8_it_is(op, channels_last):
    """A float weight on an int8 grid per output channel (tf2onnx's fold of tfmot's weight quantizer and BatchNorm;
    a channel all zeros, one ternary) becomes DequantizeLinear of those integers along the output channels, the same
    values to float32 rounding; the conversion makes the layer integer and verifies it op by op."""
    model, w = _folded_weight_graph(op, channels_last=channels_last)
    findings = Findings()
    folded, (n,) = _apply(model, weights_from_grids, findings=findings)
    assert n == 1 and list(findings.grid_weights.values()) == [127]
    dq = next(node for node in folded.graph.node if node.op_type == "DequantizeLinear" and node.output[0] in
              {i for m in folded.graph.node if m.op_type == op for i in m.input[1:2]})
    values = {t.name: onnx.numpy_helper.to_array(t) for t in folded.graph.initializer}
    q, steps = values[dq.input[0]], values[dq.input[1]]
    axis = 1 if op == "MatMul" else 0
    assert q.dtype == np.int8 and steps.shape == (w.shape[axis],)
    assert onnx.helper.get_attribute_value(dq.attribute[0]) == axis
    along = [1] * w.ndim
    along[axis] = -1
    np.testing.assert_allclose(q * steps.reshape(along), w, rtol=3e-7, atol=1e-9)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        result = quantize_qat_export(model)
    assert ("QLinearConv" if op == "Conv" else "QGemm") in ops(result.model), ops(result.model)
    assert result.verification.local_steps <= 1 and len(result.grid_weights) == 1


@pytest.mark.parametrize("on_grid, quantized_input", [(False, True), ("random", True), (True, False)],
                         ids=["a-value-off-grid", "no-grid", "float-input"])
def test_weights_from_grids_zero_cases(on_grid, quantized_input):
    """A weight with one value a third of a step off its channel's grid, a float weight on no grid, and a weight on a
    grid whose layer reads a float input: none is rewritten."""
    model, _ = _folded_weight_graph("Conv", on_grid=on_grid, quantized_input=quantized_input)
    _, (n,) = _apply(model, weights_from_grids)
    assert n == 0


def test_grid_of_takes_each_channels_coarsest_grid():
    rows = np.array([[0.3, -0.1, 0.2, 0.0], [0.5, -0.5, 0.0, 0.5], [0.0, 0.0, 0.0, 0.0]], np.float32)
    q, steps = grid_of(rows)
    np.testing.assert_array_equal(q, [[3, -1, 2, 0], [1, -1, 0, 1], [0, 0, 0, 0]])
    np.testing.assert_allclose(steps, [0.1, 0.5, 0.5], rtol=1e-6)  # an all-zero channel takes another's step
    assert grid_of(np.array([[1.0, np.pi / 10]], np.float32)) is None
    assert grid_of(np.array([[np.nan, 0.1]], np.float32)) is None and grid_of(np.array([[np.inf, 0.1]])) is None
