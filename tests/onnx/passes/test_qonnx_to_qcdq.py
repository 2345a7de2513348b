"""``qonnx_to_qcdq`` on tiny graphs: its rewrites, the op types after, the numbers in onnxruntime."""

import numpy as np
import onnx
import pytest

from recal_onnx.findings import Findings
from recal_onnx.passes.qonnx_to_qcdq import qonnx_to_qcdq
from tests.onnx.passes.graphs import NEGATIVE, ROUNDED, _apply, _x
from tests.support.onnx_graphs import Builder, ops, qonnx_model, qonnx_quant, qonnx_reference, reference


def test_qonnx_to_qcdq_computes_what_qonnx_defines():
    """QONNX's ``Quant`` as Brevitas's ``export_qonnx`` writes it and beyond: a signed 8-bit input, a per-channel
    narrow 8-bit weight (scale of shape [C, 1, 1, 1]), a 32-bit bias, a 4-bit unsigned activation (a Clip to 0..15),
    an unsigned narrow one with zero point 3 (a Clip to 0..254). Constants become their integers (int8 weight along
    axis 0, int32 bias), activations QuantizeLinear / Clip / DequantizeLinear; the model computes exactly what QONNX's
    definition (``qonnx_reference``) computes, and the QONNX domain goes."""
    b = Builder()
    rng = np.random.default_rng(0)
    w = rng.standard_normal((4, 3, 3, 3)).astype(np.float32) * 0.3
    w_scale = (np.abs(w).reshape(4, -1).max(1) / 127).astype(np.float32)
    x = qonnx_quant(b, "x", 0.05, 0, 8, signed=1)
    weight = qonnx_quant(b, b.const(w), w_scale.reshape(4, 1, 1, 1), 0, 8, signed=1, narrow=1)
    bias = qonnx_quant(b, b.const(rng.standard_normal(4).astype(np.float32) * 0.1), np.float32(0.05) * w_scale, 0,
                       32, signed=1)
    conv = b.node("Conv", [x, weight, bias], pads=[1, 1, 1, 1])
    low = qonnx_quant(b, b.node("Relu", [conv]), 0.04, 0, 4, signed=0)
    shifted = qonnx_quant(b, conv, 0.03, 3, 8, signed=0, narrow=1)
    model = qonnx_model(b, [("x", [2, 3, 6, 6])], [(b.node("Add", [low, shifted]), [2, 4, 6, 6])])
    findings = Findings()
    converted, (n,) = _apply(model, qonnx_to_qcdq, findings=findings)
    kinds = ops(converted)
    assert n == 5 and "Quant" not in kinds and kinds.count("Clip") == 2, kinds
    assert [o.domain for o in converted.opset_import] == [""]
    assert "5 Quant nodes" in findings.notes[0] and "1 of them add a zero point" in findings.notes[0]
    values = {t.name: onnx.numpy_helper.to_array(t) for t in converted.graph.initializer}
    dqs = [n for n in converted.graph.node if n.op_type == "DequantizeLinear" and n.input[0] in values]
    assert sorted(str(values[n.input[0]].dtype) for n in dqs) == ["int32", "int8"]
    assert all(a.i == 0 for n in dqs for a in n.attribute if a.name == "axis")
    feeds = _x([2, 3, 6, 6])
    np.testing.assert_array_equal(reference(converted, feeds)[0], qonnx_reference(model, feeds)[0])


@pytest.mark.parametrize("mode", list(ROUNDED))
def test_qonnx_to_qcdq_rounds_a_constant_as_its_mode_says(mode):
    """A quantized constant keeps QONNX's rounding mode, whichever of its seven (QuantizeLinear has only half to
    even, which an activation needs): the integers are those of QONNX's own table."""
    b = Builder()
    table = np.array([5.5, 2.5, 1.6, 1.1, 1.0, -5.5, -2.5, -1.6, -1.1, -1.0], np.float32)
    q = qonnx_quant(b, b.const(table), 1.0, 0, 8, signed=1, rounding_mode=mode.lower())
    model = qonnx_model(b, [("x", [10])], [(b.node("Mul", ["x", q]), [10])])
    converted, (n,) = _apply(model, qonnx_to_qcdq, findings=Findings())
    feeds = {"x": np.ones(10, np.float32)}
    got = reference(converted, feeds)[0]
    np.testing.assert_array_equal(got, ROUNDED[mode] + NEGATIVE[mode])
    np.testing.assert_array_equal(got, qonnx_reference(model, feeds)[0])
