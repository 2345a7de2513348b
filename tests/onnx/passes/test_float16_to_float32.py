"""``float16_to_float32`` on tiny graphs: its rewrites, the op types after, the numbers in onnxruntime."""

import numpy as np
import onnx

from recal_onnx.findings import Findings
from recal_onnx.passes.float16_to_float32 import float16_to_float32
from tests.onnx.passes.graphs import _apply, _x
from tests.support.onnx_graphs import Builder, reference, run


def test_float16_to_float32_computes_a_float16_qdq_model_in_float32():
    """ModelOpt's ONNX quantizer at its default: float16 scales and constants behind a Cast of the float32 input, a
    float16 output. Every constant becomes float32 (the same values), the Cast a float32 one, the output keeps its
    declared float16 through a Cast of its own; the integers are the same."""
    b = Builder()
    half = b.node("Cast", ["x"], to=onnx.TensorProto.FLOAT16)
    s, z = b.const(np.float16(0.03)), b.const(np.uint8(128))
    y = b.node("Mul", [b.node("DequantizeLinear", [b.node("QuantizeLinear", [half, s, z]), s, z]),
                       b.const(np.float16(1.5))])
    model = b.model([("x", [2, 4])], [y])
    model.graph.output[0].type.tensor_type.elem_type = onnx.TensorProto.FLOAT16
    model.opset_import[0].version = 19  # float16 scales
    feeds = _x([2, 4])
    findings = Findings()
    converted, (n,) = _apply(model, float16_to_float32, findings=findings)
    assert n == 4 and findings.notes and "float16" in findings.notes[0]  # 2 constants, 2 Casts
    assert not [t.name for t in converted.graph.initializer if t.data_type == onnx.TensorProto.FLOAT16]
    assert converted.graph.output[0].type.tensor_type.elem_type == onnx.TensorProto.FLOAT16
    got, want = run(converted, feeds)[0], reference(model, feeds)[0]
    assert got.dtype == np.float16
    np.testing.assert_allclose(got.astype(np.float32), want.astype(np.float32), rtol=1e-3)
