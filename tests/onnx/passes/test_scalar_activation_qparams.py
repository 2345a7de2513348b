"""``scalar_activation_qparams`` on tiny graphs: its rewrites, the op types after, the numbers in onnxruntime."""

import numpy as np
import onnx

from recal_onnx.passes.activations_to_uint8 import activations_to_uint8
from recal_onnx.passes.scalar_activation_qparams import scalar_activation_qparams
from tests.onnx.passes.graphs import _apply, _x
from tests.support.onnx_graphs import Builder, reference, run


def test_activations_to_uint8_keeps_values():
    b = Builder()
    s, z = b.const(np.float32(0.02)), b.const(np.int8(-5))
    y = b.node("DequantizeLinear", [b.node("QuantizeLinear", ["x", s, z]), s, z])
    model = b.model([("x", [3, 5])], [y])
    feeds = _x([3, 5])
    converted, counts = _apply(model, scalar_activation_qparams, activations_to_uint8)
    assert counts[1] == 1
    zps = [onnx.numpy_helper.to_array(t) for t in converted.graph.initializer if t.data_type == onnx.TensorProto.UINT8]
    assert zps and int(zps[0]) == 123
    np.testing.assert_array_equal(run(converted, feeds)[0], reference(model, feeds)[0])
