"""``thin_heads`` on tiny graphs: its rewrites, the op types after, the numbers in onnxruntime."""

import warnings

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from recal_core.errors import ThinningWarning
from recal_onnx import quantize_qat_export
from recal_onnx.findings import Findings
from recal_onnx.passes.thin_heads import thin_heads
from tests.onnx.passes.graphs import _apply, _attention_graph, _gqa_graph, _packed_attention_graph, _x
from tests.support.onnx_graphs import reference, run


@pytest.mark.parametrize("heads_const", [True, False], ids=["head count in the reshape", "-1"])
def test_thin_heads_removes_a_dead_head_from_every_projection(heads_const):
    model = _attention_graph(heads_const=heads_const)
    feeds = _x([1, 5, 8])
    expected = reference(model, feeds)[0]
    thinned, (n,) = _apply(model, thin_heads)
    assert n == 1
    shapes = sorted(onnx.numpy_helper.to_array(t).shape for t in thinned.graph.initializer
                    if onnx.numpy_helper.to_array(t).dtype == np.int8 and onnx.numpy_helper.to_array(t).ndim == 2)
    assert shapes == [(4, 8), (8, 4), (8, 4), (8, 4)]  # Wo loses rows; Wq, Wk, Wv lose columns
    off = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    np.testing.assert_allclose(run(thinned, feeds, level=off)[0], expected, atol=1e-6)  # the removed terms were 0
    # a default session fuses the final QDQ MatMul alike in both: within one output quantum of each other
    assert np.abs(run(thinned, feeds)[0] - run(model, feeds)[0]).max() <= 0.05


@pytest.mark.parametrize("mask", ["value bias alive", "queries and keys dead, values alive"])
def test_thin_heads_keeps_a_head_a_hostile_mask_only_half_kills(mask):
    """Head 1's value weights zero but its value bias not (its output is that bias, not 0); or its query and key
    weights and biases zero with its values alive (uniform attention: the mean of its values). Neither head is dead:
    nothing is removed and the model computes what it did."""
    model = _attention_graph()
    inits = {i.name: i for i in model.graph.initializer}
    adds = [n for n in model.graph.node if n.op_type == "Add"]

    def edit(name, change):
        values = onnx.numpy_helper.to_array(inits[name]).copy()
        change(values)
        inits[name].CopyFrom(onnx.numpy_helper.from_array(values, name))

    edit(adds[2].input[1], lambda v: v.__setitem__(slice(4, 8), 0.3))  # the value bias of head 1
    if mask != "value bias alive":
        dqs = [n for n in model.graph.node if n.op_type == "DequantizeLinear" and n.input[0] in inits
               and tuple(inits[n.input[0]].dims) == (8, 8)]
        for add, dq in zip(adds[:2], dqs[:2]):  # the query and key projections' head 1
            edit(add.input[1], lambda v: v.__setitem__(slice(4, 8), 0))
            edit(dq.input[0], lambda v: v.__setitem__((slice(None), slice(4, 8)), 0))
    feeds = _x([1, 5, 8])
    thinned, (n,) = _apply(model, thin_heads)
    assert n == 0
    off = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    np.testing.assert_array_equal(run(thinned, feeds, level=off)[0], reference(model, feeds)[0])


@pytest.mark.parametrize("norm", ["each head", "all heads"])
def test_thin_heads_follows_a_norm_of_each_heads_queries_not_one_of_all_heads(norm):
    """Qwen3 normalizes each head's queries and keys over the head's own axis: removing a head leaves the others'
    norms as they were. A norm over all heads (before they are split) would change: that attention stays whole."""
    model = _attention_graph(norm=norm)
    feeds = _x([1, 5, 8])
    findings = Findings()
    thinned, (n,) = _apply(model, thin_heads, findings=findings)
    assert n == (1 if norm == "each head" else 0)
    off = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    np.testing.assert_allclose(run(thinned, feeds, level=off)[0], reference(model, feeds)[0], atol=1e-5)
    if norm == "all heads":  # its dead head stays, said: the value layer's 4 zero outputs, and why
        (why,) = findings.heads_kept.values()
        assert why.startswith("4 outputs of the layer making its values are zero, but its queries do not come from")
    else:
        assert findings.heads_kept == {}


@pytest.mark.parametrize("per_head", [False, True], ids=["blocks (GPT-2)", "per head (GPT-NeoX)"])
def test_thin_heads_takes_a_dead_heads_rows_from_a_packed_projection(per_head):
    model = _packed_attention_graph(per_head)
    feeds = _x([1, 5, 8])
    thinned, (n,) = _apply(model, thin_heads)
    assert n == 1
    shapes = sorted(onnx.numpy_helper.to_array(t).shape for t in thinned.graph.initializer
                    if onnx.numpy_helper.to_array(t).dtype == np.int8 and onnx.numpy_helper.to_array(t).ndim == 2)
    assert shapes == [(4, 8), (8, 12)]  # Wo loses rows; the packed W the head's 4 columns of each of Q, K and V
    split = next(n for n in thinned.graph.node if n.op_type == "Split")
    sizes = next(t for t in thinned.graph.initializer if t.name == split.input[1])
    assert onnx.numpy_helper.to_array(sizes).tolist() == [4, 4, 4]  # blocks: 8 each before; per head: unchanged
    off = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    np.testing.assert_allclose(run(thinned, feeds, level=off)[0], run(model, feeds, level=off)[0], atol=1e-6)


def test_thin_heads_zero_rewrites():
    _, (n,) = _apply(_attention_graph(dead_head=None), thin_heads)
    assert n == 0  # every head alive


def test_thin_heads_removes_a_dead_key_value_head_with_its_query_heads_through_rotary_and_repeat():
    """Grouped-query attention: a unit is a key/value head and the query heads that read it; the rotary embedding
    works within each head, and the repeat's Expand and Reshape shapes are rewritten to the heads left."""
    model = _gqa_graph()
    feeds = _x([1, 5, 8])
    expected = reference(model, feeds)[0]
    thinned, (n,) = _apply(model, thin_heads)
    assert n == 2  # query heads 2 and 3 with key/value head 1
    shapes = sorted(onnx.numpy_helper.to_array(t).shape for t in thinned.graph.initializer
                    if onnx.numpy_helper.to_array(t).dtype == np.int8 and onnx.numpy_helper.to_array(t).ndim == 2)
    assert shapes == [(4, 8), (8, 2), (8, 2), (8, 4)]  # Wo loses rows; Wq two heads' columns, Wk and Wv one head's
    for level in (ort.GraphOptimizationLevel.ORT_DISABLE_ALL, None):
        np.testing.assert_allclose(run(thinned, feeds, level=level)[0], expected, atol=0.05)
    off = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    np.testing.assert_allclose(run(thinned, feeds, level=off)[0], run(model, feeds, level=off)[0], atol=1e-6)
    _, (n,) = _apply(_gqa_graph(dead_unit=None), thin_heads)
    assert n == 0


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
