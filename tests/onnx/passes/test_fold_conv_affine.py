"""``fold_conv_affine`` on tiny graphs: its rewrites, the op types after, the numbers in onnxruntime."""

import numpy as np
import pytest

from recal_onnx.passes.conv_to_qlinearconv import conv_to_qlinearconv
from recal_onnx.passes.fold_conv_affine import fold_conv_affine
from tests.onnx.passes.graphs import _apply, _conv_graph, _x
from tests.support.onnx_graphs import ops, reference, run


def test_fold_conv_affine_div_add_batchnorm():
    def chain(b, y):
        c = b.rng.uniform(0.5, 2.0, (1, 4, 1, 1)).astype(np.float32)
        y = b.node("Div", [y, b.const(c)])
        y = b.node("Add", [y, b.const(b.rng.standard_normal((1, 4, 1, 1)).astype(np.float32))])
        gamma = np.array([1.5, -0.7, 0.9, 1.1], np.float32)  # a negative scale flips a channel's int8 signs
        stats = [gamma, np.float32([0.1, 0.2, -0.3, 0.0]), np.float32([0.5, -0.2, 0.1, 0.0]),
                 np.float32([1.2, 0.8, 2.0, 0.5])]
        return b.node("BatchNormalization", [y, *[b.const(s) for s in stats]], epsilon=1e-5)

    model = _conv_graph(bias=False, extra=chain)
    feeds = _x([2, 3, 6, 6])
    expected = reference(model, feeds)[0]
    folded, (n,) = _apply(model, fold_conv_affine)
    assert n == 3
    assert not {"Div", "Add", "BatchNormalization"} & set(ops(folded))
    np.testing.assert_allclose(reference(folded, feeds)[0], expected, atol=0.02 + 1e-6)
    converted, (m,) = _apply(folded, conv_to_qlinearconv)
    assert m == 1 and np.abs(run(converted, feeds)[0] - expected).max() <= 0.02 * 2


def test_fold_conv_affine_zero_rewrites():
    model = _conv_graph(relu=True)
    _, (n,) = _apply(model, fold_conv_affine)
    assert n == 0


@pytest.mark.parametrize("shape, folds", [((1, 4, 1, 1), 1), ((4, 1, 1), 1), ((1,), 1), ((1, 4), 0), ((4,), 0),
                                          ((1, 4, 1), 0), ((1, 1, 1, 4), 0), ((2, 4, 1, 1), 0)])
def test_fold_conv_affine_folds_only_what_broadcasts_to_the_channel_axis(shape, folds):
    """Under ONNX broadcasting a Conv's [N, 4, 4, 4] output times a [1, 4] or [4] constant scales its last axis
    (width), and a [1, 4, 1] one its height, not its channels: folding that into the weight would make a wrong model. Only a constant whose
    right-aligned shape varies along axis 1 alone is per channel."""
    def chain(b, y):
        return b.node("Mul", [y, b.const(b.rng.uniform(0.5, 2.0, shape).astype(np.float32))])

    model = _conv_graph(bias=False, extra=chain, input_shape=(2, 3, 4, 4))
    feeds = _x([2, 3, 4, 4])
    expected = reference(model, feeds)[0]
    folded, (n,) = _apply(model, fold_conv_affine)
    assert n == folds
    np.testing.assert_allclose(reference(folded, feeds)[0], expected, atol=0.02 + 1e-6)
