"""The pipeline as a whole: its declared order, its passes run as onnx_ir passes, and conversions that only several
passes together get right."""

import numpy as np
import onnxruntime as ort
import pytest

from recal_onnx import quantize_qat_export
from recal_onnx.passes.bias_to_int32 import bias_to_int32
from recal_onnx.passes.conv_to_qlinearconv import conv_to_qlinearconv
from tests.support.onnx_graphs import Builder, ops


def test_a_batchnorm_between_quantizers_is_exact_on_every_input_value():
    """Q -> DQ -> BatchNormalization -> Q (quantize_static without pre-processing): the integer depthwise conv gives
    what onnxruntime gives for the QDQ model as written on all 256 values of every channel, in a default session
    and with optimizations off (the weight of +-64 with its bias rounded differed near 1 value in 64)."""


    rng = np.random.default_rng(3)
    channels = 16
    b = Builder()
    params = [b.const(v.astype(np.float32)) for v in (rng.uniform(0.2, 3, channels), rng.normal(0, 1, channels),
                                                       rng.normal(0, 1, channels), rng.uniform(0.1, 2, channels))]
    y = b.node("BatchNormalization", [b.qdq("x", 0.037, 128), *params], epsilon=1e-5)
    model = b.model([("x", [1, channels, 256, 1])], [b.qdq(y, 0.041, 128)])
    result = quantize_qat_export(model, verify=False)
    assert "QLinearConv" in ops(result.model) and "BatchNormalization" not in ops(result.model)
    feed = {"x": np.broadcast_to(np.arange(256, dtype=np.float32).reshape(1, 1, 256, 1) * 0.037 - 128 * 0.037,
                                 (1, channels, 256, 1)).copy()}
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    want = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"]).run(None, feed)[0]
    for level in (ort.GraphOptimizationLevel.ORT_DISABLE_ALL, ort.GraphOptimizationLevel.ORT_ENABLE_ALL):
        options.graph_optimization_level = level
        got = ort.InferenceSession(result.model.SerializeToString(), options,
                                   providers=["CPUExecutionProvider"]).run(None, feed)[0]
        inexact = next((n for n in result.notes if "except" in n), "")
        assert np.array_equal(got, want) or inexact, (np.count_nonzero(got != want), result.notes)
    assert any("on all 256 input values of every channel" in n for n in result.notes)


def test_the_pipeline_declares_every_pass_module_once_in_order():
    """recal_onnx.pipeline is the one place the converter's order is written: every module in passes/ is one pass of
    it, named as its module (the name the conversion's report counts rewrites under), the QOperator passes repeat
    together, and the format decides which steps run."""
    import pkgutil

    import recal_onnx.passes as passes_package
    from recal_onnx.pipeline import PIPELINE, READERS, Options

    declared = {p.__module__.rsplit(".", 1)[1] for step in PIPELINE for p in (*step.passes, *READERS)}
    modules = {m.name for m in pkgutil.iter_modules(passes_package.__path__)}
    assert modules - declared == set(), modules - declared
    passes = {p for step in PIPELINE for p in step.passes} | set(READERS)
    assert [p.__name__ for p in passes if p.__module__.rsplit(".", 1)[1] != p.__name__] == []
    qoperator = [s for s in PIPELINE if s.when(Options(format="qoperator")) and not s.when(Options(format="qdq"))]
    assert len(qoperator) == 1 and qoperator[0].repeat and conv_to_qlinearconv in qoperator[0].passes
    assert not any(bias_to_int32 in s.passes for s in PIPELINE if s.when(Options(format="qoperator")))


def test_a_step_runs_as_onnx_ir_passes_repeats_until_none_rewrites_and_a_refusal_keeps_its_type():
    """Each rewrite runs as an onnx_ir pass under a PassManager: a repeated step sweeps until a sweep rewrites
    nothing, the rewrites are counted under the pass's name, and a pass's ModelError reaches the caller as itself,
    not as the pass infrastructure's PassError."""
    import onnx_ir as ir

    from recal_onnx import ModelError
    from recal_onnx.conversion_pass import ConversionPass, run_passes
    from recal_onnx.ir_edits import Graph

    b = Builder()
    g = Graph(b.model([("x", [1, 4])], [b.node("Relu", ["x"])]))
    left = [3]

    def countdown(graph):
        left[0] -= 1 if left[0] else 0
        return 1 if left[0] else 0

    def refuses(graph):
        raise ModelError("node 'x': no integer kernel")

    passes = [ConversionPass(countdown, g)]
    run_passes(passes, repeat=True)
    assert isinstance(passes[0], ir.passes.InPlacePass) and passes[0].name == "countdown"
    assert passes[0].rewrites == 2 and left == [0]
    with pytest.raises(ModelError, match="no integer kernel"):
        run_passes([ConversionPass(refuses, g)])
