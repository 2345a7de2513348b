"""``fold_weight_transposes`` on tiny graphs: its rewrites, the op types after, the numbers in onnxruntime."""

import numpy as np

from recal_onnx.passes.conv_to_qlinearconv import conv_to_qlinearconv
from recal_onnx.passes.fold_weight_reshapes import fold_weight_reshapes
from recal_onnx.passes.fold_weight_transposes import fold_weight_transposes
from tests.onnx.passes.graphs import _apply, _depthwise_as_tf2onnx_writes_it, _x
from tests.support.onnx_graphs import Builder, ops, reference, run


def test_fold_weight_transposes_zero_case_an_activation_transpose_stays():
    b = Builder()
    y = b.node("Transpose", [b.qdq("x", 0.05, 128)], perm=[0, 2, 1])
    model = b.model([("x", [2, 3, 4])], [y])
    converted, (n,) = _apply(model, fold_weight_transposes)
    assert n == 0 and "Transpose" in ops(converted)


def test_fold_weight_reshapes_lets_a_keras_depthwise_conv_become_integer():
    model = _depthwise_as_tf2onnx_writes_it()
    feeds = _x([2, 4, 6, 6])
    expected = reference(model, feeds)[0]
    assert _apply(model, fold_weight_transposes, conv_to_qlinearconv)[1] == [0, 0]  # the reshape hides the weight
    converted, counts = _apply(model, fold_weight_reshapes, fold_weight_transposes, conv_to_qlinearconv)
    assert counts == [1, 1, 1] and ops(converted) == ["QuantizeLinear", "QLinearConv", "DequantizeLinear"]
    np.testing.assert_allclose(run(converted, feeds)[0], expected, atol=0.05 + 1e-6)
