"""Each rewrite pass on a tiny graph: how many rewrites, the op types after, numbers in onnxruntime."""

import warnings

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from recal_core.errors import ThinningWarning
from recal_onnx import quantize_qat_export
from recal_onnx.ir_edits import Graph
from recal_onnx.passes.bias_to_int32 import bias_to_int32
from recal_onnx.passes.conv_to_qlinearconv import conv_to_qlinearconv
from tests.onnx.passes.graphs import _apply, _attention_graph, _x
from tests.support.onnx_graphs import Builder, ops, reference, run


@pytest.mark.parametrize("group", [16, 48], ids=["groups-of-16", "per-row"])
def test_gather_int4_tables(group):
    """An int4 table (recal's grouped rows, or one scale a row) is gathered packed by GatherBlockQuantized, the same
    rows; an int8 table is left to the int8 gather."""
    from recal_onnx.passes.gather_int4_tables import gather_int4_tables

    for levels, expected in ((7, 1), (127, 0)):
        b = Builder()
        vocab, width = 10, 48
        q = b.rng.integers(-levels, levels + 1, (vocab * width // group, group)).astype(np.int8)
        scale = b.rng.uniform(0.01, 0.05, q.shape[0]).astype(np.float32)
        dq = b.node("DequantizeLinear", [b.const(q, "w"), b.const(scale, "ws"),
                                         b.const(np.zeros(scale.size, np.int8))], axis=0)
        table = b.node("Reshape", [dq, b.const(np.array([vocab, width], np.int64))])
        y = b.node("Gather", [table, "ids"], axis=0)
        graph = onnx.helper.make_graph(b.nodes, "t", [onnx.helper.make_tensor_value_info("ids", onnx.TensorProto.INT64,
                                                                                          [2, 3])],
                                       [onnx.helper.make_tensor_value_info(y, onnx.TensorProto.FLOAT, None)], b.inits)
        model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 17)])
        feeds = {"ids": np.array([[0, 9, 3], [3, 3, 1]], np.int64)}
        want = reference(model, feeds)[0]
        converted, (n,) = _apply(model, gather_int4_tables)
        assert n == expected
        if expected:
            assert ops(converted) == ["GatherBlockQuantized"]
            for level in (None, ort.GraphOptimizationLevel.ORT_DISABLE_ALL):
                np.testing.assert_array_equal(run(converted, feeds, level=level)[0], want)


def test_a_conversion_names_the_attentions_whose_zero_heads_it_cannot_remove():
    """Nothing silent: an attention the converter cannot follow keeps its zero heads with a ThinningWarning that
    names it and why; one whose heads are all alive is not mentioned."""
    with pytest.warns(ThinningWarning, match=r"1 attention keeps heads that look pruned .*\n  '.*': 4 outputs of "
                                             r"the layer making its values are zero, but its queries do not come"):
        result = quantize_qat_export(_attention_graph(norm="all heads"))
    assert len(result.heads_kept) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error", ThinningWarning)
        assert quantize_qat_export(_attention_graph(dead_head=None, norm="all heads")).heads_kept == {}


def test_a_shape_of_a_dequantized_tensor_reads_its_integers():
    """ShuffleNet's ``x.size()``: a DequantizeLinear read only by a Shape is not computed; the shape is the same."""
    from recal_onnx.passes.shapes_from_integers import shapes_from_integers

    b = Builder()
    x = b.qdq("x", 0.05, 128)
    shape = b.node("Shape", [x])
    model = b.model([("x", ["n", 4, 3, 3])], [shape])
    model.graph.output[0].type.tensor_type.elem_type = onnx.TensorProto.INT64
    converted, (n,) = _apply(model, shapes_from_integers)
    assert n == 1 and "DequantizeLinear" not in ops(converted), ops(converted)
    feeds = _x([2, 4, 3, 3])
    assert run(converted, feeds)[0].tolist() == reference(model, feeds)[0].tolist() == [2, 4, 3, 3]


def test_drop_exporter_metadata_keeps_other_keys():
    """The torch exporter's per-node record goes (its bytes counted); a user's own node metadata stays."""
    from recal_onnx.passes.drop_exporter_metadata import drop_exporter_metadata

    b = Builder()
    y = b.node("Relu", ["x"])
    model = b.model([("x", [2, 3])], [y])
    onnx.helper.set_metadata_props(model.graph.node[0], {"namespace": "m: M/relu: aten.relu",
                                                         "pkg.torch.onnx.stack_trace": 'File "/home/me/m.py"',
                                                         "owner": "team-a"})
    g = Graph(model)
    assert drop_exporter_metadata(g) == len("namespace") + len("m: M/relu: aten.relu") + len(
        "pkg.torch.onnx.stack_trace") + len('File "/home/me/m.py"')
    kept = g.commit().graph.node[0].metadata_props
    assert {p.key: p.value for p in kept} == {"owner": "team-a"}


def test_a_batchnorm_between_quantizers_is_exact_on_every_input_value():
    """Q -> DQ -> BatchNormalization -> Q (quantize_static without pre-processing): the integer depthwise conv gives
    what onnxruntime gives for the QDQ model as written on all 256 values of every channel, in a default session
    and with optimizations off (the weight of +-64 with its bias rounded differed near 1 value in 64)."""
    import onnxruntime as ort

    from recal_onnx import quantize_qat_export

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
