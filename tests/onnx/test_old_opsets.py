"""QDQ files at opsets before 13, as peers write them for models exported at 11 or 12 (paddle2onnx's PaddleOCR
models, through NNCF or ModelOpt): the converted model loads, passes ``onnx.checker`` and computes what onnxruntime
runs the file as."""

import numpy as np
import onnx
import pytest

from recal_onnx import UnconvertedOpsWarning, quantize_qat_export

from tests.support.onnx_graphs import Builder, run


def _conv_bn_pool(opset: int, per_channel_axis_attr: bool):
    """x -> Conv (a float input, as NNCF leaves a first conv's) -> BatchNormalization -> Q/DQ -> MaxPool -> Q/DQ ->
    Conv -> Q/DQ, at ``opset``."""
    b = Builder(seed=3)
    w = b.weight((8, 3, 3, 3), per_channel=per_channel_axis_attr)
    y = b.node("Conv", ["x", w], pads=[1, 1, 1, 1])
    rng = np.random.default_rng(0)
    bn = [b.const(v.astype(np.float32)) for v in (rng.uniform(0.5, 1.5, 8), rng.normal(0, 0.1, 8),
                                                  rng.normal(0, 0.1, 8), rng.uniform(0.5, 1.5, 8))]
    y = b.qdq(b.node("BatchNormalization", [y, *bn]), 0.05, 128)
    y = b.qdq(b.node("MaxPool", [y], kernel_shape=[2, 2], strides=[2, 2]), 0.05, 128)
    y = b.qdq(b.node("Conv", [y, b.weight((4, 8, 1, 1), per_channel=per_channel_axis_attr)]), 0.04, 128)
    model = b.model([("x", [2, 3, 8, 8])], [y])
    del model.opset_import[:]
    model.opset_import.append(onnx.helper.make_opsetid("", opset))
    return model


@pytest.mark.parametrize("opset", [11, 12])
def test_a_qdq_file_before_opset_13_converts_and_loads(opset, tmp_path):
    """Per-tensor weights (NNCF's at these opsets): the passes' own per-channel scales (the BatchNorm folded into
    the float first conv's weight) are onnxruntime's DequantizeLinear; at 11, MaxPool, which has no 8-bit type
    before 12, stays float."""
    from recal_onnx.ir_edits import MS_DOMAIN

    model = _conv_bn_pool(opset, False)
    feeds = {"x": np.random.default_rng(1).normal(0, 1, (2, 3, 8, 8)).astype(np.float32)}
    expected = run(model, feeds, as_written=True)[0]
    if opset == 11:
        with pytest.warns(UnconvertedOpsWarning, match="MaxPool takes 8-bit integers from opset 12"):
            result = quantize_qat_export(model, tmp_path / "int8.onnx", inputs=feeds)
    else:
        result = quantize_qat_export(model, tmp_path / "int8.onnx", inputs=feeds)
    converted = onnx.load(str(result.path))  # onnx.checker passed on it in the converter
    ops = {n.op_type for n in converted.graph.node}
    assert "QLinearConv" in ops, ops
    assert ("MaxPool" in result.float_ops) == (opset == 11), result.float_ops
    per_channel = [n for n in converted.graph.node if n.op_type == "DequantizeLinear"
                   and any(a.name == "axis" for a in n.attribute)]
    assert per_channel and all(n.domain == MS_DOMAIN for n in per_channel)
    assert np.abs(run(converted, feeds)[0] - expected).max() <= 3 * 0.04 + 1e-6
