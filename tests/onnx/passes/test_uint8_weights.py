"""``uint8_weights`` on tiny graphs: its rewrites, the op types after, the numbers in onnxruntime."""

import numpy as np
import onnx
import pytest

from recal_onnx.passes.conv_to_qlinearconv import conv_to_qlinearconv
from recal_onnx.passes.gemm_to_qgemm import gemm_to_qgemm
from recal_onnx.passes.uint8_weights import uint8_weights
from tests.onnx.passes.graphs import _apply, _conv_graph, _gemm_graph, _integer_weights, _matmul_graph, _x
from tests.support.onnx_graphs import Builder, reference, run


@pytest.mark.parametrize("graph, convert, step", [
    (lambda: (_conv_graph(), [2, 3, 6, 6]), (), 0.02),  # QDQ: the DequantizeLinear's constant
    (lambda: (_conv_graph(), [2, 3, 6, 6]), (conv_to_qlinearconv,), 0.02),
    (_gemm_graph, (gemm_to_qgemm,), 0.04),
    (_matmul_graph, (gemm_to_qgemm,), 0.05),  # 3-D: MatMulIntegerToFloat
], ids=["qdq-conv", "QLinearConv", "QGemm", "MatMulIntegerToFloat"])
def test_uint8_weights(graph, convert, step):
    """Weights beyond +-64 become uint8 (zero point 128), the same values: exact in onnxruntime on every x86
    CPU, with or without VNNI (u8s8 kernels without it add uint8 x int8 pairs in int16 and saturate)."""
    model, shape = graph()
    feeds = _x(shape)
    before, _ = _apply(model, *convert)
    converted, (*_, n) = _apply(model, *convert, uint8_weights)
    assert n == 1
    assert _integer_weights(before) == [np.int8] and _integer_weights(converted) == [np.uint8]
    # as written, on any CPU: within one output step (bias rounding) of the QDQ model run in float
    assert np.abs(run(converted, feeds, as_written=True)[0] - reference(model, feeds)[0]).max() <= step + 1e-6
    small = Builder()
    w = small.weight((4, 3, 3, 3))
    scale = [i for i in small.inits if i.name.startswith("w") and i.data_type == onnx.TensorProto.INT8][0]
    scale.CopyFrom(onnx.numpy_helper.from_array(
        (onnx.numpy_helper.to_array(scale) // 2).astype(np.int8), scale.name))  # within +-64: left int8
    y = small.node("Conv", [small.qdq("x", 0.03, 128), w], pads=[1, 1, 1, 1])
    _, (n,) = _apply(small.model([("x", [2, 3, 6, 6])], [small.qdq(y, 0.02, 0)]), uint8_weights)
    assert n == 0
