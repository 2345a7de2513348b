"""``pool_to_qlinear`` on tiny graphs: its rewrites, the op types after, the numbers in onnxruntime."""

import re

import numpy as np
import pytest

from recal_onnx.passes.binary_to_qlinear import binary_to_qlinear
from recal_onnx.passes.pool_to_qlinear import pool_to_qlinear
from recal_onnx.passes.remove_redundant_qdq import remove_redundant_qdq
from recal_onnx.passes.sigmoid_to_qlinear import sigmoid_to_qlinear
from tests.onnx.passes.graphs import _apply, _x
from tests.support.onnx_graphs import Builder, ops, reference, run


def test_squeeze_excitation_gate_is_qlinearsigmoid_then_qlinearmul():
    """x * Q(sigmoid(Q(mean(x)))), the gate broadcast over the feature map: QLinearSigmoid and QLinearMul (a rank
    4 gate of shape 2x4x1x1) compute what the QDQ model computes, to the output step."""
    b = Builder()
    x = b.qdq("x", 0.0297, 128)
    pooled = b.qdq(b.node("GlobalAveragePool", [x]), 0.0113, 128)
    gate = b.qdq(b.node("Sigmoid", [pooled]), 1 / 255, 0)
    model = b.model([("x", [2, 4, 5, 5])], [b.qdq(b.node("Mul", [x, gate]), 0.0213, 128)])
    feeds = _x([2, 4, 5, 5])
    expected = reference(model, feeds)[0]
    converted, (pools, sigmoids, muls, _) = _apply(model, pool_to_qlinear, sigmoid_to_qlinear, binary_to_qlinear,
                                                   remove_redundant_qdq)
    assert (pools, sigmoids, muls) == (1, 1, 1)
    assert {"Sigmoid", "Mul", "GlobalAveragePool"}.isdisjoint(ops(converted))
    assert {"QLinearSigmoid", "QLinearMul", "QLinearGlobalAveragePool"} <= set(ops(converted))
    got = run(converted, feeds)[0]
    assert np.abs(got - expected).max() <= 0.0213 + 1e-6
    assert np.mean(np.abs(got - expected) < 1e-6) > 0.99  # all but a rounding tie are the same integer


@pytest.mark.parametrize("op", ["GlobalAveragePool", "ReduceMean", "AveragePool", "ReduceMean channels-last",
                                "ReduceMean channels-last keepdims"])
def test_pool_to_qlinear(op):
    """Every global or windowed average pool of a quantized tensor becomes onnxruntime's integer pool, a Keras
    channels-last mean (PyTorch and JAX backends) included, keeping its dims or not."""
    b = Builder()
    x = b.qdq("x", 0.03, 128)
    if op.startswith("ReduceMean channels-last"):
        y = b.node("ReduceMean", [x], axes=[1, 2], keepdims=int(op.endswith("keepdims")))
        op = "ReduceMean"
    elif op == "ReduceMean":
        y = b.node(op, [x], axes=[2, 3], keepdims=1)
    elif op == "AveragePool":
        y = b.node(op, [x], kernel_shape=[2, 2], strides=[2, 2])
    else:
        y = b.node(op, [x])
    model = b.model([("x", [2, 3, 4, 4])], [b.qdq(y, 0.01, 128)])
    feeds = _x([2, 3, 4, 4])
    expected = reference(model, feeds)[0]
    converted, (n,) = _apply(model, pool_to_qlinear)
    assert n == 1 and op not in ops(converted)
    assert np.abs(run(converted, feeds)[0] - expected).max() <= 0.01 + 1e-6


@pytest.mark.parametrize("out_scale, fate", [(1e9, "could not move off its zero point"),
                                             (1e-9, "would always saturate")])
def test_a_global_pool_on_grids_onnxruntimes_integer_pool_refuses_is_a_broken_qat_model(out_scale, fate):
    """A global average pool whose output grid is ~1e9 times coarser or finer than its input's: onnxruntime's integer
    pool throws at run time (as its own session of the QDQ file does), so the converter refuses the model as broken,
    naming the pool, the scales and why, before anything runs."""
    from recal_onnx import ModelError

    b = Builder()
    y = b.node("GlobalAveragePool", [b.qdq("x", 0.01, 128)])
    model = b.model([("x", [1, 4, 3, 3])], [b.qdq(y, out_scale, 128)])
    scale = re.escape(f"{out_scale:.3g}")
    with pytest.raises(ModelError, match=rf"GlobalAveragePool 'GlobalAveragePool\d+' averages on input scale 0.01 "
                                         rf"into output scale {scale}: over 9 values its output {fate}"):
        _apply(model, pool_to_qlinear)
