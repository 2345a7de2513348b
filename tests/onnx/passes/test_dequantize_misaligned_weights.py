"""``dequantize_misaligned_weights`` on tiny graphs: its rewrites, the op types after, the numbers in onnxruntime."""

import numpy as np
import onnxruntime as ort
import pytest

from recal_onnx.findings import Findings
from recal_onnx.passes.dequantize_misaligned_weights import dequantize_misaligned_weights
from recal_onnx.passes.shield_float_weights import shield_float_weights
from tests.onnx.passes.graphs import _apply, _x
from tests.support.onnx_graphs import Builder, reference, run


def test_a_weight_scaled_per_input_channel_is_written_as_its_float_values():
    """DQ(x), DQ(w, axis=1) -> Conv -> Q: left float by the converter, but onnxruntime's default session fuses it into
    a QLinearConv that fails at run time ("filter scale shape invalid"). With the weight written as the float32 values
    DequantizeLinear computes (its input then shielded as every float layer's is), the default session runs and
    gives what the file as written means; a per-output-channel weight is left as it is."""

    def graph(axis):
        b = Builder()
        x = b.qdq("x", 0.05, 128)
        y = b.qdq(b.node("Conv", [x, b.weight((4, 3, 3, 3), axis=axis)]), 0.1, 128)
        return b.model([("x", [1, 3, 6, 6])], [y])

    model, feeds = graph(axis=1), _x((1, 3, 6, 6))
    with pytest.raises(Exception, match="filter scale shape invalid"):
        run(model, feeds, level=ort.GraphOptimizationLevel.ORT_ENABLE_ALL)
    findings = Findings()
    result, counts = _apply(model, dequantize_misaligned_weights, shield_float_weights, findings=findings)
    assert counts == [1, 1] and "scales are along axis 1, not its output channels (axis 0)" in \
        findings.kept_float[next(iter(findings.kept_float))][1]
    np.testing.assert_array_equal(run(result, feeds, level=ort.GraphOptimizationLevel.ORT_ENABLE_ALL)[0],
                                  reference(model, feeds)[0])
    assert _apply(graph(axis=0), dequantize_misaligned_weights, findings=Findings())[1] == [0]
