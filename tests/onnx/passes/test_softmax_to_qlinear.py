"""``softmax_to_qlinear`` on tiny graphs: its rewrites, the op types after, the numbers in onnxruntime."""

import numpy as np
import pytest

from recal_onnx.findings import Findings
from recal_onnx.passes.softmax_to_qlinear import softmax_to_qlinear
from tests.onnx.passes.graphs import _apply, _softmax_graph, _steps_apart
from tests.support.onnx_graphs import ops


@pytest.mark.parametrize("out_scale, kernel", [(np.float32(1 / 255), "QLinearSoftmax"), (np.float32(1 / 256),
                                                "QLinearSoftmax"), (np.float32(0.93 / 255), "Softmax")])
def test_softmax_to_qlinear_where_the_kernel_computes_on_the_output_grid(out_scale, kernel):
    """quantize_static's softmax output (scale 1/255) becomes QLinearSoftmax with a y_scale the kernel floors to 255;
    a calibrated scale (not 1/K) stays float, dequantized by Cast/Mul so onnxruntime cannot fuse it into its kernel,
    which computes on the grid 1/floor(1/scale). Both equal the QDQ model as written in a default session; the QDQ
    model itself, run by a default session, does not where 1/scale is no exact float integer."""
    model = _softmax_graph(out_scale)
    feeds = {"x": np.random.default_rng(3).standard_normal((2, 4, 16, 16)).astype(np.float32) * 3}
    findings = Findings()
    converted, (n,) = _apply(model, softmax_to_qlinear, findings=findings)
    assert n == 1 and kernel in ops(converted)
    assert ("Cast" in ops(converted)) == (kernel == "Softmax")  # dequantized apart
    differ, steps = _steps_apart(model, converted, feeds, out_scale)
    assert differ == 0 and steps < 0.5
    if out_scale != np.float32(1 / 256):  # onnxruntime's own fusion of the file as written: another grid
        assert _steps_apart(model, model, feeds, out_scale)[0] > 0
    assert (kernel == "Softmax") == bool(findings.kept_float)
    if kernel == "Softmax":
        assert "1/floor(1/scale)" in next(iter(findings.kept_float.values()))[1]


def test_softmax_in_a_qdq_file_stays_what_onnxruntime_fuses_exactly():
    """The qdq format leaves a softmax whose output grid onnxruntime's kernel computes on (1/256) to onnxruntime's
    fusion, and keeps one on 1/255 float (dequantized apart), with the reason."""
    feeds = {"x": np.random.default_rng(4).standard_normal((2, 4, 16, 16)).astype(np.float32) * 3}
    exact, (n,) = _apply(_softmax_graph(np.float32(1 / 256)), lambda g: softmax_to_qlinear(g, False))
    assert n == 0
    model, findings = _softmax_graph(np.float32(1 / 255)), Findings()
    apart, (n,) = _apply(model, lambda g, findings: softmax_to_qlinear(g, False, findings), findings=findings)
    assert n == 1 and "QLinearSoftmax" not in ops(apart) and "floors to 254" in str(findings.kept_float)
    assert _steps_apart(model, apart, feeds, np.float32(1 / 255))[0] == 0
