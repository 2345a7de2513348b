"""``thin_channels`` on tiny graphs: its rewrites, the op types after, the numbers in onnxruntime."""

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from recal_onnx.passes.thin_channels import thin_channels
from tests.onnx.passes.graphs import _apply, _thin_every_channel, _two_convs, _x
from tests.support.onnx_graphs import Builder, reference, run


def test_thin_channels_removes_dead_filters_and_the_inputs_that_read_them():
    model = _two_convs()
    feeds = _x([2, 3, 6, 6])
    expected = reference(model, feeds)[0]
    assert _apply(model, thin_channels)[1] == [0]  # 2 of 4 channels left: fewer than a block of 16, kept whole
    thinned, (n,) = _apply(model, _thin_every_channel)
    assert n == 2
    weights = sorted(onnx.numpy_helper.to_array(t).shape for t in thinned.graph.initializer
                     if onnx.numpy_helper.to_array(t).ndim == 4)
    assert weights == [(2, 2, 1, 1), (2, 3, 3, 3)]
    # the same sums (the removed terms were zero), accumulated in another order: at most one output quantum
    assert np.abs(run(thinned, feeds)[0] - expected).max() <= 0.05 + 1e-6


@pytest.mark.parametrize("dead, also_output", [((), False), ((1, 3), True)], ids=["none dead", "output"])
def test_thin_channels_zero_rewrites(dead, also_output):
    _, (n,) = _apply(_two_convs(dead, also_output), _thin_every_channel)
    assert n == 0  # no dead channel, or the channels are a graph output


def test_thin_channels_leaves_a_matmul_reading_a_convs_width_alone():
    """Conv (NCHW, filters 1 and 3 dead) -> Relu -> MatMul(W[6, 5]): the MatMul contracts the width, not the
    channels, so nothing is thinned; the same filters before a Gemm after a flatten would go."""
    b = Builder()
    w = b.weight((4, 3, 3, 3))
    q = next(t for t in b.inits if t.name == b.nodes[-1].input[0])
    values = onnx.numpy_helper.to_array(q).copy()
    values[[1, 3]] = 0
    q.CopyFrom(onnx.numpy_helper.from_array(values, q.name))
    y = b.qdq(b.node("Relu", [b.node("Conv", [b.qdq("x", 0.03, 128), w], pads=[1, 1, 1, 1])]), 0.02, 0)
    model = b.model([("x", [2, 3, 6, 6])], [b.node("MatMul", [y, b.weight((6, 5), axis=1)])])
    feeds = _x([2, 3, 6, 6])
    thinned, (n,) = _apply(model, _thin_every_channel)
    assert n == 0
    np.testing.assert_allclose(run(thinned, feeds)[0], run(model, feeds)[0], atol=1e-6)


def test_thin_channels_reads_gelus_tanh_form_and_a_gated_product():
    """GPT-2's GELU written out (``0.5 x (1 + tanh(0.798 (x + 0.0447 x^3)))``) keeps a dead neuron dead: MatMul(W[8, 32],
    neurons 16..31 zero with their bias) -> GELU -> MatMul(W[32, 4]) loses those 16 inputs."""
    b = Builder()
    w = b.weight((8, 32), axis=1)
    q = next(t for t in b.inits if t.name == b.nodes[-1].input[0])
    values = onnx.numpy_helper.to_array(q).copy()
    values[:, 16:] = 0
    q.CopyFrom(onnx.numpy_helper.from_array(values, q.name))
    bias = b.rng.standard_normal(32).astype(np.float32) * 0.1
    bias[16:] = 0
    x = b.node("Add", [b.node("MatMul", [b.qdq("x", 0.03, 128), w]), b.const(bias, "bias")])
    inner = b.node("Mul", [b.node("Add", [x, b.node("Mul", [b.node("Pow", [x, b.const(np.float32(3.0))]),
                                                            b.const(np.float32(0.044715))])]),
                           b.const(np.float32(0.7978845608))])
    gelu = b.node("Mul", [b.node("Mul", [x, b.const(np.float32(0.5))]),
                          b.node("Add", [b.node("Tanh", [inner]), b.const(np.float32(1.0))])])
    model = b.model([("x", [2, 5, 8])], [b.node("MatMul", [b.qdq(gelu, 0.02, 0), b.weight((32, 4), axis=1)])])
    feeds = _x([2, 5, 8])
    thinned, (n,) = _apply(model, thin_channels)
    assert n == 16
    shapes = sorted(onnx.numpy_helper.to_array(t).shape for t in thinned.graph.initializer
                    if onnx.numpy_helper.to_array(t).ndim == 2)
    assert shapes == [(8, 16), (16, 4)]
    np.testing.assert_allclose(run(thinned, feeds, level=ort.GraphOptimizationLevel.ORT_DISABLE_ALL)[0],
                               run(model, feeds, level=ort.GraphOptimizationLevel.ORT_DISABLE_ALL)[0], atol=1e-6)


def test_thin_channels_keeps_whole_blocks_of_16():
    """40 channels, 11 dead: 32 stay (the first 3 dead ones among them), as onnxruntime runs such counts fastest."""
    b = Builder()
    w = b.weight((40, 3, 3, 3))
    q = next(i for i in b.inits if i.name.startswith("w") and i.data_type == onnx.TensorProto.INT8)
    values = onnx.numpy_helper.to_array(q).copy()
    dead = [1, 4, 7, 10, 13, 16, 19, 22, 25, 28, 31]
    values[dead] = 0
    q.CopyFrom(onnx.numpy_helper.from_array(values, q.name))
    y = b.qdq(b.node("Relu", [b.node("Conv", [b.qdq("x", 0.03, 128), w], pads=[1, 1, 1, 1])]), 0.02, 0)
    model = b.model([("x", [2, 3, 6, 6])], [b.node("Conv", [y, b.weight((4, 40, 1, 1))])])
    feeds = _x([2, 3, 6, 6])
    thinned, (n,) = _apply(model, thin_channels)
    assert n == 8
    shapes = sorted(onnx.numpy_helper.to_array(t).shape for t in thinned.graph.initializer
                    if onnx.numpy_helper.to_array(t).ndim == 4)
    assert shapes == [(4, 32, 1, 1), (32, 3, 3, 3)]
    np.testing.assert_allclose(run(thinned, feeds)[0], reference(model, feeds)[0], atol=1e-4)
