"""``fold_weight_reshapes`` on tiny graphs: its rewrites, the op types after, the numbers in onnxruntime."""

from recal_onnx.passes.fold_weight_reshapes import fold_weight_reshapes
from tests.onnx.passes.graphs import _apply, _depthwise_as_tf2onnx_writes_it
from tests.support.onnx_graphs import ops


def test_fold_weight_reshapes_zero_case_a_reshape_that_mixes_channels_stays():
    model = _depthwise_as_tf2onnx_writes_it(new_shape=(3, 4, 3, 1))  # channels no longer on an axis of their own
    converted, (n,) = _apply(model, fold_weight_reshapes)
    assert n == 0 and "Reshape" in ops(converted)
