"""``activations_to_uint8`` on tiny graphs: its rewrites, the op types after, the numbers in onnxruntime."""

import warnings

import numpy as np
import onnx

from recal_onnx import quantize_qat_export
from recal_onnx.passes.activations_to_uint8 import activations_to_uint8
from tests.onnx.passes.graphs import _apply, _x
from tests.support.onnx_graphs import Builder, ops, reference, run


def test_activations_to_uint8_follows_integers_through_data_movement():
    """TFLite's int8 activations as tf2onnx writes them: a pool's ``Q(int8, zp) -> Squeeze -> DQ`` before a Gemm.
    The Q, and the DQ behind the Squeeze, both become uint8 (an integer pool with one type in and out), and the
    conversion is integer throughout; a Q whose integers something other than data movement reads stays int8."""
    b = Builder()
    x = b.qdq("x", 0.05, -3, dtype=np.int8)
    s, z = b.const(np.float32(0.04)), b.const(np.int8(-8))
    pooled = b.node("QuantizeLinear", [b.node("GlobalAveragePool", [x]), s, z])
    flat = b.node("DequantizeLinear", [b.node("Squeeze", [pooled, b.const(np.array([2, 3]))]), s, z])
    y = b.qdq(b.node("Gemm", [flat, b.weight((6, 4)), b.const(np.zeros(6, np.float32))], transB=1), 0.05, -8,
              dtype=np.int8)
    model = b.model([("x", [2, 4, 5, 5])], [y])
    feeds = _x([2, 4, 5, 5])
    converted, (n,) = _apply(model, activations_to_uint8)
    assert n == 3
    np.testing.assert_array_equal(reference(converted, feeds)[0], reference(model, feeds)[0])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        result = quantize_qat_export(model)
    assert {"QLinearGlobalAveragePool", "QGemm"} <= set(ops(result.model)), ops(result.model)
    b = Builder()
    q = b.node("QuantizeLinear", ["x", b.const(np.float32(0.04)), b.const(np.int8(-8))])
    model = b.model([("x", [3, 5])], [b.node("Cast", [q], to=onnx.TensorProto.FLOAT)])
    assert _apply(model, activations_to_uint8)[1] == [0]


def test_activations_to_uint8_moves_a_qcdq_clip_with_its_integers():
    """An int8 activation clipped on its integers (QCDQ: a narrow range, as QONNX's ``narrow`` or fewer bits write
    it) becomes uint8 with its Clip's bounds moved by 128: the same values, and a Gemm after it then reads uint8
    (onnxruntime has no QGemm of uint8 input and int8 output)."""
    b = Builder()
    s, z = b.const(np.float32(0.03)), b.const(np.int8(0))
    q = b.node("Clip", [b.node("QuantizeLinear", ["x", s, z]), b.const(np.int8(-127)), b.const(np.int8(127))])
    model = b.model([("x", [2, 4])], [b.node("DequantizeLinear", [q, s, z])])
    converted, (n,) = _apply(model, activations_to_uint8)
    values = {t.name: onnx.numpy_helper.to_array(t) for t in converted.graph.initializer}
    clip = next(node for node in converted.graph.node if node.op_type == "Clip")
    assert n == 1 and [int(values[i]) for i in clip.input[1:]] == [1, 255]
    assert all(values[node.input[2]].dtype == np.uint8 for node in converted.graph.node if node.op_type.endswith("Linear"))
    feeds = {"x": np.linspace(-5, 5, 8, dtype=np.float32).reshape(2, 4)}
    np.testing.assert_array_equal(run(converted, feeds)[0], reference(model, feeds)[0])
