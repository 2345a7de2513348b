"""``widen_weights`` on tiny graphs: its rewrites, the op types after, the numbers in onnxruntime."""

import numpy as np
import onnx
import pytest

from recal_onnx.passes.conv_to_qlinearconv import conv_to_qlinearconv
from recal_onnx.passes.matmul_to_nbits import matmul_to_nbits
from recal_onnx.passes.widen_weights import widen_weights
from tests.onnx.passes.graphs import _apply, _int4, _opset21, _x
from tests.support.onnx_graphs import ops, reference, run


def test_widen_weights_reads_a_4bit_conv_weight_as_the_int8_it_holds():
    """An int4 per-channel weight (opset 21) becomes int8 with the same integers; the conv then becomes QLinearConv
    with the QDQ model's numbers."""
    rng = np.random.default_rng(0)
    q = rng.integers(-8, 8, (4, 3, 3, 3))
    inits = [onnx.numpy_helper.from_array(np.float32(0.03), "xs"), onnx.numpy_helper.from_array(np.uint8(128), "xz"),
             _int4("w", q), onnx.numpy_helper.from_array(np.full(4, 0.05, np.float32), "ws"),
             _int4("wz", np.zeros(4, int)), onnx.numpy_helper.from_array(np.float32(0.05), "ys"),
             onnx.numpy_helper.from_array(np.uint8(128), "yz")]
    h = onnx.helper
    nodes = [h.make_node("QuantizeLinear", ["x", "xs", "xz"], ["xq"]), h.make_node("DequantizeLinear", ["xq", "xs", "xz"], ["xf"]),
             h.make_node("DequantizeLinear", ["w", "ws", "wz"], ["wf"], axis=0),
             h.make_node("Conv", ["xf", "wf"], ["y"], pads=[1, 1, 1, 1]),
             h.make_node("QuantizeLinear", ["y", "ys", "yz"], ["yq"]), h.make_node("DequantizeLinear", ["yq", "ys", "yz"], ["out"])]
    model = _opset21(nodes, [("x", [2, 3, 6, 6])], ["out"], inits)
    feeds = _x([2, 3, 6, 6])
    converted, (widened, convs) = _apply(model, widen_weights, conv_to_qlinearconv)
    assert (widened, convs) == (1, 1) and "QLinearConv" in ops(converted)
    assert not any(t.data_type == onnx.TensorProto.INT4 for t in converted.graph.initializer)
    assert np.abs(run(converted, feeds)[0] - reference(model, feeds)[0]).max() <= 0.05 + 1e-6


@pytest.mark.parametrize("symmetric, layout", [(True, "K,N"), (False, "K,N"), (True, "N,K transposed"),
                                               (False, "N,K gemm")])
def test_widen_weights_makes_a_blocked_matmul_weight_grouped_rows_for_matmulnbits(symmetric, layout):
    """``DequantizeLinear(int4 | uint4 [K, N], block_size=16)`` before a MatMul (onnxruntime's MatMulNBitsQuantizer),
    or ``[N, K]`` blocked along axis 1 read through a Transpose or by ``Gemm(transB=1)`` (a torch Linear's layout),
    becomes recal's grouped rows, then MatMulNBits in 4 bits (a uint4 weight with a zero point a block): the same
    float output to the last bit."""
    rng = np.random.default_rng(1)
    k, n, block = 64, 24, 16
    axis = 0 if layout == "K,N" else 1
    shape = (k, n) if axis == 0 else (n, k)
    blocks = (k // block, n) if axis == 0 else (n, k // block)
    q = rng.integers(-8, 8, shape) if symmetric else rng.integers(0, 16, shape)
    zp = None if symmetric else rng.integers(3, 13, blocks)
    kind = onnx.TensorProto.INT4 if symmetric else onnx.TensorProto.UINT4
    inits = [_int4("w", q, kind), onnx.numpy_helper.from_array(rng.uniform(0.01, 0.05, blocks).astype(np.float32), "ws")]
    inputs = ["w", "ws"]
    if zp is not None:
        inits.append(_int4("wz", zp, kind))
        inputs.append("wz")
    h = onnx.helper
    nodes = [h.make_node("DequantizeLinear", inputs, ["wf"], axis=axis, block_size=block)]
    if layout == "K,N":
        nodes.append(h.make_node("MatMul", ["x", "wf"], ["out"]))
    elif layout == "N,K transposed":
        nodes += [h.make_node("Transpose", ["wf"], ["wt"], perm=[1, 0]), h.make_node("MatMul", ["x", "wt"], ["out"])]
    else:
        nodes.append(h.make_node("Gemm", ["x", "wf"], ["out"], transB=1))
    model = _opset21(nodes, [("x", [3, k])], ["out"], inits)
    feeds = _x([3, k])
    converted, (rows, nbits) = _apply(model, widen_weights, matmul_to_nbits)
    assert (rows, nbits) == (1, 1) and ops(converted) == ["MatMulNBits"]
    node = converted.graph.node[0]
    assert {a.name: a.i for a in node.attribute}["bits"] == 4 and (len(node.input) > 3) == (not symmetric)
    np.testing.assert_array_equal(run(converted, feeds)[0], reference(model, feeds)[0])
