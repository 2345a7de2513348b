"""``zero_channel_scales`` on tiny graphs: its rewrites, the op types after, the numbers in onnxruntime."""

import numpy as np
import onnx
import pytest

from recal_onnx.passes.bias_to_int32 import bias_to_int32
from recal_onnx.passes.conv_to_qlinearconv import conv_to_qlinearconv
from recal_onnx.passes.zero_channel_scales import zero_channel_scales
from tests.onnx.passes.graphs import _apply, _x
from tests.support.onnx_graphs import Builder, reference, run


@pytest.mark.parametrize("fmt_passes", [(conv_to_qlinearconv,), (bias_to_int32,)], ids=["qoperator", "qdq"])
def test_zero_channel_scales_keep_the_bias_of_a_filter_pruned_whole(fmt_passes):
    """A filter pruned whole, exported with a tiny scale and a large bias (a folded BatchNorm shift): without
    the pass its int32 bias overflows and the channel's output is lost; with it the bias is held exactly."""
    b = Builder()
    x = b.qdq("x", 0.03, 128)
    w = b.weight((4, 3, 3, 3))
    dq = next(n for n in b.nodes if n.output[0] == w)
    q_init, s_init = (next(i for i in b.inits if i.name == name) for name in dq.input[:2])
    q, s = onnx.numpy_helper.to_array(q_init).copy(), onnx.numpy_helper.to_array(s_init).copy()
    q[1], s[1] = 0, 1e-8 / 127
    q_init.CopyFrom(onnx.numpy_helper.from_array(q, q_init.name))
    s_init.CopyFrom(onnx.numpy_helper.from_array(s, s_init.name))
    y = b.node("Conv", [x, w, b.const(np.array([0.1, 2.0, -0.1, 0.2], np.float32), "bias")], pads=[1, 1, 1, 1])
    model = b.model([("x", [2, 3, 6, 6])], [b.qdq(y, 0.02, 128)])
    feeds = _x([2, 3, 6, 6])
    expected = reference(model, feeds)[0]
    converted, (n, *_) = _apply(model, zero_channel_scales, *fmt_passes)
    assert n == 1
    assert np.abs(run(converted, feeds)[0] - expected).max() <= 0.02 + 1e-6
    # the zero channel's scale is chosen for its bias: 2.0 becomes 2**30 steps of s_x * s_w, held exactly
    biases = [onnx.numpy_helper.to_array(t) for t in converted.graph.initializer if t.data_type == onnx.TensorProto.INT32
              and t.dims == [4]]
    assert len(biases) == 1 and abs(int(biases[0][1]) - 2 ** 30) <= 2 ** 30 * 1e-6  # float32 scale: +-1 part in 1e7
    unguarded, _ = _apply(model, *fmt_passes)
    assert np.abs(run(unguarded, feeds)[0] - expected).max() > 1.0  # channel 1 lost its bias of 2.0
