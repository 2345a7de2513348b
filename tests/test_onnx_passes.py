"""Each rewrite pass on a tiny graph: how many rewrites, the op types after, numbers in onnxruntime."""

import re
import warnings

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from recal_core.errors import ThinningWarning
from recal_onnx import quantize_qat_export
from recal_onnx.findings import Findings
from recal_onnx.ir_edits import Graph
from recal_onnx.passes.activations_to_uint8 import activations_to_uint8
from recal_onnx.passes.scalar_activation_qparams import scalar_activation_qparams
from recal_onnx.passes.affine_to_batchnorm import affine_to_batchnorm
from recal_onnx.passes.bias_apart import bias_apart
from recal_onnx.passes.batchnorm_to_conv import batchnorm_to_conv
from recal_onnx.passes.bias_to_int32 import bias_to_int32
from recal_onnx.passes.binary_to_qlinear import binary_to_qlinear
from recal_onnx.passes.concat_to_qlinear import concat_to_qlinear
from recal_onnx.passes.constants_to_initializers import constants_to_initializers
from recal_onnx.passes.fold_constants import fold_constants
from recal_onnx.passes.inputs_to_constants import inputs_to_constants
from recal_onnx.passes.remove_identities import remove_identities
from recal_onnx.passes.conv_to_qlinearconv import conv_to_qlinearconv
from recal_onnx.passes.weights_from_grids import grid_of, weights_from_grids
from recal_onnx.passes.shield_float_weights import shield_float_weights
from recal_onnx.passes.finer_weight_grids import finer_weight_grids
from recal_onnx.passes.float16_to_float32 import float16_to_float32
from recal_onnx.passes.merge_twin_qdq import merge_twin_qdq
from recal_onnx.passes.fold_conv_affine import fold_conv_affine
from recal_onnx.passes.fusible_qdq_pools import fusible_qdq_pools
from recal_onnx.passes.gather_int8_tables import gather_int8_tables
from recal_onnx.passes.gemm_to_qgemm import gemm_to_qgemm
from recal_onnx.passes.int8_passthrough import int8_passthrough
from recal_onnx.passes.minmax_to_clip import minmax_to_clip
from recal_onnx.passes.dequantize_misaligned_weights import dequantize_misaligned_weights
from recal_onnx.passes.remove_noop_clamps import remove_noop_clamps
from recal_onnx.passes.fold_pads_into_convs import fold_pads_into_convs
from recal_onnx.passes.pool_to_qlinear import pool_to_qlinear
from recal_onnx.passes.qonnx_to_qcdq import qonnx_to_qcdq
from recal_onnx.passes.encodings_to_qdq import encodings_to_qdq
from recal_onnx.aimet_encodings import load_encodings
from recal_onnx.passes.remove_redundant_qdq import remove_redundant_qdq
from recal_onnx.passes.sigmoid_to_qlinear import sigmoid_to_qlinear
from recal_onnx.passes.masks_to_exact_zeros import masks_to_exact_zeros
from recal_onnx.passes.softmax_to_qlinear import softmax_to_qlinear
from recal_onnx.passes.standard_qdq import standard_qdq
from recal_onnx.passes.widen_weights import widen_weights
from recal_onnx.passes.matmul_to_nbits import matmul_to_nbits
from recal_onnx.passes.uint8_weights import uint8_weights
from recal_onnx.passes.unary_to_table import unary_to_table
from recal_onnx.passes.thin_channels import thin_channels
from recal_onnx.passes.thin_heads import thin_heads
from recal_onnx.passes.fold_weight_reshapes import fold_weight_reshapes
from recal_onnx.passes.fold_weight_transposes import fold_weight_transposes
from recal_onnx.passes.zero_channel_scales import zero_channel_scales

from .onnx_graphs import Builder, ops, qonnx_model, qonnx_quant, qonnx_reference, reference, run


def _apply(model, *passes, findings=None):
    model = onnx.shape_inference.infer_shapes(model)
    g = Graph(model)
    counts = [p(g, findings=findings) if findings is not None and "findings" in p.__code__.co_varnames else p(g)
              for p in passes]
    model = g.commit()
    onnx.checker.check_model(model)
    return model, counts


def _x(shape, seed=1):
    return {"x": np.random.default_rng(seed).standard_normal(shape).astype(np.float32)}


def _conv_graph(relu=False, bias=True, out_zp=0, extra=None, input_shape=(2, 3, 6, 6)):
    b = Builder()
    x = b.qdq("x", 0.03, 128)
    w = b.weight((4, 3, 3, 3))
    inputs = [x, w] + ([b.const(b.rng.standard_normal(4).astype(np.float32) * 0.1, "bias")] if bias else [])
    y = b.node("Conv", inputs, pads=[1, 1, 1, 1])
    if extra:
        y = extra(b, y)
    if relu:
        y = b.node("Relu", [y])
    y = b.qdq(y, 0.02, out_zp)
    return b.model([("x", list(input_shape))], [y])


@pytest.mark.parametrize("relu, out_zp", [(False, 100), (True, 0), (True, 40)])
def test_conv_to_qlinearconv(relu, out_zp):
    model = _conv_graph(relu=relu, out_zp=out_zp)
    feeds = _x([2, 3, 6, 6])
    expected = reference(model, feeds)[0]
    converted, (n,) = _apply(model, conv_to_qlinearconv)
    assert n == 1
    assert "QLinearConv" in ops(converted) and "Conv" not in ops(converted) and "Relu" not in ops(converted)
    assert ("Max" in ops(converted)) == (relu and out_zp != 0)
    got = run(converted, feeds)[0]
    assert np.abs(got - expected).max() <= 0.02 + 1e-6  # at most one output quantum (bias rounding)


def test_bias_apart():
    """A conv the converter left float for its bias (``findings.kept_float``) adds the bias in an Add of its own, the
    same numbers; a conv not recorded there keeps its bias."""
    model = _conv_graph()
    feeds = _x([2, 3, 6, 6])
    g = Graph(onnx.shape_inference.infer_shapes(model))
    conv = next(n for n in g.nodes if n.op_type == "Conv")
    findings = Findings()
    assert bias_apart(g, findings) == 0
    findings.kept_float[conv.name] = ("Conv", "its bias is beyond int32")
    assert bias_apart(g, findings) == 1 and len(conv.inputs) == 2
    apart = g.commit()
    assert ops(apart).count("Add") == 1 and ops(apart).index("Conv") < ops(apart).index("Add")
    np.testing.assert_allclose(reference(apart, feeds)[0], reference(model, feeds)[0], atol=1e-6)


def test_conv_to_qlinearconv_zero_rewrites_for_a_float_weight():
    b = Builder()
    y = b.node("Conv", [b.qdq("x", 0.03, 128), b.const(np.ones((2, 3, 1, 1), np.float32))])
    model = b.model([("x", [1, 3, 4, 4])], [b.qdq(y, 0.1, 0)])
    _, (n,) = _apply(model, conv_to_qlinearconv)
    assert n == 0


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


def test_fold_constants_turns_weight_quantize_into_int8():
    b = Builder()
    w = b.node("Mul", [b.const(np.full((2, 3, 1, 1), 0.5, np.float32)), b.const(np.float32(2.0))])
    s, z = b.const(np.float32(0.01)), b.const(np.int8(0))
    wq = b.node("DequantizeLinear", [b.node("QuantizeLinear", [w, s, z]), s, z])
    y = b.node("Conv", [b.qdq("x", 0.05, 128), b.node("Identity", [wq])])
    model = b.model([("x", [1, 3, 2, 2])], [y])
    folded, counts = _apply(model, constants_to_initializers, remove_identities, fold_constants)
    assert counts[1] == 1 and counts[2] == 2
    assert ops(folded).count("QuantizeLinear") == 1  # only the activation's
    _, again = _apply(folded, fold_constants)
    assert again == [0]


def test_gemm_to_qgemm_quantized_and_float_outputs():
    b = Builder()
    a = b.qdq("x", 0.05, 120)
    h = b.node("Gemm", [a, b.weight((16, 8)), b.const(np.zeros(16, np.float32) + 0.1)], transB=1)
    h = b.qdq(b.node("Relu", [h]), 0.04, 0)
    logits = b.node("Gemm", [h, b.weight((16, 4), axis=1), b.const(np.float32([0.1, -0.2, 0.3, 0.0]))])
    model = b.model([("x", [5, 8])], [logits])
    feeds = _x([5, 8])
    expected = reference(model, feeds)[0]
    converted, (n,) = _apply(model, gemm_to_qgemm)
    assert n == 2 and ops(converted).count("QGemm") == 2 and "Gemm" not in ops(converted)
    np.testing.assert_allclose(run(converted, feeds)[0], expected, atol=0.05)


@pytest.mark.parametrize("bias, quantized_out", [("on grid", True), ("on grid", False), ("off grid", True),
                                                 ("none", True)])
def test_matmul_3d_becomes_a_flattened_qgemm_or_matmul_integer_to_float(bias, quantized_out):
    """A ``[batch, tokens, hidden]`` MatMul (+ bias) becomes QGemm on ``[-1, hidden]`` and is reshaped back (bias
    and requantization inside the GEMM; float out where nothing quantizes it), for any batch and sequence; a float
    bias between its int32 steps (another tool's export) keeps MatMulIntegerToFloat, which adds it exactly."""
    b = Builder()
    a = b.qdq("x", 0.05, 128)
    w = b.weight((8, 6), axis=1)
    y = b.node("MatMul", [a, w])
    if bias != "none":
        scale = 0.05 * onnx.numpy_helper.to_array(next(t for t in b.inits if t.name.startswith("ws")))
        value = np.round(np.linspace(-3, 3, 6) / scale) * scale + (0.3 * scale if bias == "off grid" else 0)
        y = b.node("Add", [y, b.const(value.astype(np.float32))])
    model = b.model([("x", ["batch", "tokens", 8])], [b.qdq(y, 0.05, 128) if quantized_out else y])
    converted, (n,) = _apply(model, gemm_to_qgemm)
    kinds = ops(converted)
    assert n == 1 and (kinds.count("QGemm") == 1) == (bias != "off grid"), kinds
    assert ("MatMulIntegerToFloat" in kinds) == (bias == "off grid"), kinds
    for shape in ([2, 3, 8], [1, 5, 8]):
        feeds = _x(shape)
        expected, got = reference(model, feeds)[0], run(converted, feeds)[0]
        assert got.shape == expected.shape
        np.testing.assert_allclose(got, expected, atol=(0.05 if quantized_out else 1e-5) + 1e-6)


def test_add_to_qlinearadd_and_zero_case():
    b = Builder()
    y = b.node("Add", [b.qdq("x", 0.03, 128), b.qdq("x", 0.05, 100)])
    model = b.model([("x", [2, 4, 3, 3])], [b.qdq(b.node("Relu", [y]), 0.06, 10)])
    feeds = _x([2, 4, 3, 3])
    expected = reference(model, feeds)[0]
    converted, (n,) = _apply(model, binary_to_qlinear)
    assert n == 1 and ops(converted).count("QLinearAdd") == 1 and "Max" in ops(converted)
    assert np.abs(run(converted, feeds)[0] - expected).max() <= 0.06 + 1e-6

    b = Builder()
    y = b.node("Add", [b.qdq("x", 0.03, 128), b.node("Relu", ["x"])])  # one input is float
    model = b.model([("x", [1, 2])], [b.qdq(y, 0.06, 10)])
    _, (n,) = _apply(model, binary_to_qlinear)
    assert n == 0


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


def _opset21(nodes, inputs, outputs, inits, domain=""):
    graph = onnx.helper.make_graph(nodes, "g", [onnx.helper.make_tensor_value_info(n, onnx.TensorProto.FLOAT, s)
                                                for n, s in inputs],
                                   [onnx.helper.make_tensor_value_info(n, onnx.TensorProto.FLOAT, None) for n in outputs],
                                   inits)
    opsets = [onnx.helper.make_opsetid("", 21)] + ([onnx.helper.make_opsetid(domain, 1)] if domain else [])
    return onnx.helper.make_model(graph, opset_imports=opsets, ir_version=10)


def _int4(name, values, dtype=onnx.TensorProto.INT4):
    values = np.asarray(values)
    return onnx.helper.make_tensor(name, dtype, values.shape, values.reshape(-1).tolist())


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


def test_standard_qdq_reads_onnxruntimes_own_qdq_where_the_opset_defines_it():
    """``com.microsoft`` Q/DQ of uint8 become the default domain's (their arithmetic is the same); uint16 ones stay."""
    h = onnx.helper
    inits = [onnx.numpy_helper.from_array(np.float32(0.03), "s"), onnx.numpy_helper.from_array(np.uint8(128), "z"),
             onnx.numpy_helper.from_array(np.uint16(30000), "z16")]
    nodes = [h.make_node("QuantizeLinear", ["x", "s", "z"], ["q"], domain="com.microsoft"),
             h.make_node("DequantizeLinear", ["q", "s", "z"], ["f"], domain="com.microsoft"),
             h.make_node("QuantizeLinear", ["f", "s", "z16"], ["q16"], domain="com.microsoft"),
             h.make_node("DequantizeLinear", ["q16", "s", "z16"], ["out"], domain="com.microsoft")]
    model = _opset21(nodes, [("x", [2, 8])], ["out"], inits, domain="com.microsoft")
    g = Graph(model)
    assert standard_qdq(g) == 2
    assert [n.domain for n in g.nodes] == ["", "", "com.microsoft", "com.microsoft"]
    feeds = _x([2, 8])
    np.testing.assert_array_equal(run(g.commit(), feeds)[0], reference(model, feeds)[0])


def test_a_quantized_constant_beside_an_activation_becomes_a_qlinear_operand():
    """``Add(DQ(x), DQ(bias [C] int8))`` (quantize_static's bias after a MatMul) and ``Mul(DQ(x), DQ(scalar))`` (an
    attention's scale): QLinearAdd / QLinearMul with the constant's integers moved to uint8 and given x's rank."""
    b = Builder()
    x = b.qdq("x", 0.03, 128)
    bias = b.node("DequantizeLinear", [b.const(np.arange(-8, 8, dtype=np.int8) * 9, "bq"), b.const(np.float32(0.01)),
                                       b.const(np.int8(0))])
    y = b.qdq(b.node("Add", [x, bias]), 0.04, 120)
    scale = b.node("DequantizeLinear", [b.const(np.uint8(200)), b.const(np.float32(0.005)), b.const(np.uint8(0))])
    model = b.model([("x", [2, 5, 16])], [b.qdq(b.node("Mul", [y, scale]), 0.04, 128)])
    feeds = _x([2, 5, 16])
    converted, (n,) = _apply(model, binary_to_qlinear)
    assert n == 2 and {"QLinearAdd", "QLinearMul"} <= set(ops(converted)) and not {"Add", "Mul"} & set(ops(converted))
    assert np.abs(run(converted, feeds)[0] - reference(model, feeds)[0]).max() <= 0.04 + 1e-6


def test_fold_constants_requantizes_a_dequantized_constant():
    """``QuantizeLinear(DequantizeLinear(c))`` (quantize_static requantizing a bias torch's exporter shared with a
    LayerNorm) folds to its integers; the DequantizeLinear itself stays (a weight's pattern)."""
    b = Builder()
    shared = b.node("DequantizeLinear", [b.const(np.array([3, -5, 7], np.int8)), b.const(np.float32(0.1))])
    requantized = b.node("QuantizeLinear", [shared, b.const(np.float32(0.05)), b.const(np.uint8(100))])
    model = b.model([("x", [1, 3])], [b.node("Add", ["x", b.node("DequantizeLinear", [requantized, b.const(
        np.float32(0.05)), b.const(np.uint8(100))])]), b.node("Mul", ["x", shared])])
    g = Graph(model)
    assert fold_constants(g) == 1
    assert [n.op_type for n in g.nodes].count("QuantizeLinear") == 0
    feeds = _x([1, 3])
    for got, expected in zip(run(g.commit(), feeds), reference(model, feeds)):
        np.testing.assert_array_equal(got, expected)


def _softmax_graph(out_scale):
    b = Builder()
    p = b.node("Softmax", [b.qdq("x", 0.05, 128)], axis=-1)
    return b.model([("x", [2, 4, 16, 16])], [b.qdq(p, out_scale, 0)])


def _steps_apart(model, converted, feeds, step):
    """How many output values of ``converted`` in a default session differ from ``model`` as written (in steps)."""
    diff = np.abs(run(converted, feeds, as_written=True)[0] - reference(model, feeds)[0]) / step
    return int(np.count_nonzero(diff > 0.5)), float(diff.max())


@pytest.mark.parametrize("out_scale, kernel", [(np.float32(1 / 255), "QLinearSoftmax"), (np.float32(1 / 256),
                                                "QLinearSoftmax"), (np.float32(0.93 / 255), "Softmax")])
def test_softmax_to_qlinear_where_the_kernel_computes_on_the_output_grid(out_scale, kernel):
    """quantize_static's softmax output (scale 1/255) becomes QLinearSoftmax with a y_scale the kernel floors to 255;
    a calibrated scale (not 1/K) stays float, dequantized by Cast/Mul so onnxruntime cannot fuse it into its kernel,
    which computes on the grid 1/floor(1/scale). Both equal the QDQ model as written in a default session; the QDQ
    model itself, run by a default session, does not where 1/scale is no exact float integer."""
    model = _softmax_graph(out_scale)
    feeds = {"x": np.random.default_rng(3).standard_normal((2, 4, 16, 16)).astype(np.float32) * 3}
    findings = Findings()
    converted, (n,) = _apply(model, softmax_to_qlinear, findings=findings)
    assert n == 1 and kernel in ops(converted)
    assert ("Cast" in ops(converted)) == (kernel == "Softmax")  # dequantized apart
    differ, steps = _steps_apart(model, converted, feeds, out_scale)
    assert differ == 0 and steps < 0.5
    if out_scale != np.float32(1 / 256):  # onnxruntime's own fusion of the file as written: another grid
        assert _steps_apart(model, model, feeds, out_scale)[0] > 0
    assert (kernel == "Softmax") == bool(findings.kept_float)
    if kernel == "Softmax":
        assert "1/floor(1/scale)" in next(iter(findings.kept_float.values()))[1]


def test_softmax_in_a_qdq_file_stays_what_onnxruntime_fuses_exactly():
    """The qdq format leaves a softmax whose output grid onnxruntime's kernel computes on (1/256) to onnxruntime's
    fusion, and keeps one on 1/255 float (dequantized apart), with the reason."""
    feeds = {"x": np.random.default_rng(4).standard_normal((2, 4, 16, 16)).astype(np.float32) * 3}
    exact, (n,) = _apply(_softmax_graph(np.float32(1 / 256)), lambda g: softmax_to_qlinear(g, False))
    assert n == 0
    model, findings = _softmax_graph(np.float32(1 / 255)), Findings()
    apart, (n,) = _apply(model, lambda g, findings: softmax_to_qlinear(g, False, findings), findings=findings)
    assert n == 1 and "QLinearSoftmax" not in ops(apart) and "floors to 254" in str(findings.kept_float)
    assert _steps_apart(model, apart, feeds, np.float32(1 / 255))[0] == 0


def test_a_sigmoid_without_a_quantized_output_stays_float():
    b = Builder()
    model = b.model([("x", [1, 4])], [b.node("Sigmoid", [b.qdq("x", 0.03, 128)])])
    _, (n,) = _apply(model, sigmoid_to_qlinear)
    assert n == 0


@pytest.mark.parametrize("out_scale, out_zp, clamps", [(0.04, 40, ["Max", "Min"]), (0.04, 0, ["Min"]),
                                                       (0.02, 0, [])])  # 6 is beyond 255 steps
def test_relu6_after_a_conv_folds_into_its_integers(out_scale, out_zp, clamps):
    """Conv -> Clip(0, 6) -> Q: the clamp becomes Max / Min on the integers only where the output type's own
    range does not already do it, and the result equals the QDQ model's (monotone rounding: exact)."""
    def relu6(b, y):
        return b.node("Clip", [y, b.const(np.float32(0.0)), b.const(np.float32(6.0))])

    model = _conv_graph(extra=relu6)
    quantize = next(n for n in model.graph.node if n.op_type == "QuantizeLinear" and n.input[0].startswith("clip"))
    inits = {i.name: i for i in model.graph.initializer}
    inits[quantize.input[1]].CopyFrom(onnx.numpy_helper.from_array(np.float32(out_scale), quantize.input[1]))
    inits[quantize.input[2]].CopyFrom(onnx.numpy_helper.from_array(np.uint8(out_zp), quantize.input[2]))
    feeds = {"x": _x([2, 3, 6, 6])["x"] * 4}  # conv outputs well past 6 and below 0
    expected = reference(model, feeds)[0]
    top = min(6.0, (255 - out_zp) * out_scale)
    assert expected.max() == pytest.approx(top, abs=out_scale) and expected.min() == pytest.approx(0, abs=out_scale)
    converted, (n,) = _apply(model, conv_to_qlinearconv)
    assert n == 1 and "Clip" not in ops(converted)
    assert [op for op in ops(converted) if op in ("Max", "Min")] == clamps
    assert np.abs(run(converted, feeds)[0] - expected).max() <= out_scale + 1e-6  # the conv's own rounding


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


@pytest.mark.parametrize("pool, rewritten", [("ReduceMean", True), ("channel mean", False),
                                             ("GlobalAveragePool", False), ("GlobalAveragePool -> Flatten", True)])
def test_qdq_pools_are_written_as_onnxruntime_fuses_them(pool, rewritten, tmp_path):
    """The dynamo exporter's global pool (``DQ -> ReduceMean(2, 3) -> Q``) and a pool flattened before its Q
    both run in float under onnxruntime's QDQ fusion; rewritten, each is QLinearGlobalAveragePool, the numbers the
    same. A mean over the channels is no pool; ``DQ -> GlobalAveragePool -> Q`` is fused already."""
    b = Builder()
    x = b.qdq("x", 0.0297, 128)
    if pool == "ReduceMean" or pool == "channel mean":
        y = b.node("ReduceMean", [x], axes=[2, 3] if pool == "ReduceMean" else [1], keepdims=1)
    else:
        y = b.node("GlobalAveragePool", [x])
    if pool.endswith("Flatten"):
        y = b.node("Flatten", [y])
    model = b.model([("x", [2, 3, 4, 4])], [b.qdq(y, 0.0113, 128)])
    feeds = _x([2, 3, 4, 4])
    expected = reference(model, feeds)[0]
    converted, (n,) = _apply(model, fusible_qdq_pools)
    assert n == rewritten and ("ReduceMean" in ops(converted)) == (pool == "channel mean")
    options = ort.SessionOptions()
    options.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    ort.InferenceSession(converted.SerializeToString(), options, providers=["CPUExecutionProvider"])
    assert ("QLinearGlobalAveragePool" in ops(onnx.load(tmp_path / "optimized.onnx"))) == (pool != "channel mean")
    np.testing.assert_array_equal(run(converted, feeds)[0], expected)


@pytest.mark.parametrize("shape_op", ["Squeeze", "Flatten", "Squeeze Reshape"])
def test_pool_to_qlinear_through_a_shape_op_rounds_once(shape_op):
    """GlobalAveragePool -> Squeeze -> Q (tf2onnx's Keras/TF pooling; squeeze-excitation reshapes back to 4-D
    after it): one rounding, to the Q's grid, as the QDQ model computes; int8_passthrough leaves it to
    pool_to_qlinear instead of rounding at the input's scale first."""
    b = Builder()
    y = b.node("GlobalAveragePool", [b.qdq("x", 0.05, 0)])
    y = b.node("Squeeze", [y, b.const(np.array([2, 3], np.int64))]) if shape_op != "Flatten" else b.node("Flatten", [y])
    if shape_op.endswith("Reshape"):
        y = b.node("Reshape", [y, b.const(np.array([64, 1, 1, 8], np.int64))])
    model = b.model([("x", [64, 8, 4, 4])], [b.qdq(y, 0.004, 0)])  # a grid 12.5x finer than the input's
    feeds = {"x": np.random.default_rng(3).uniform(0, 2, (64, 8, 4, 4)).astype(np.float32)}
    expected = reference(model, feeds)[0]
    converted, (passed, n) = _apply(model, int8_passthrough, pool_to_qlinear)
    assert (passed, n) == (0, 1) and ops(converted) == [
        "QuantizeLinear", "QLinearGlobalAveragePool", *shape_op.split(), "DequantizeLinear"]
    steps = np.abs(run(converted, feeds)[0] - expected) / 0.004
    assert steps.max() <= 1 + 1e-3 and np.median(steps) == 0  # rounded at the input's 0.05: up to 6 steps off


def test_int8_passthrough_maxpool_reshape_relu():
    b = Builder()
    x = b.qdq("x", 0.03, 128)
    y = b.node("MaxPool", [x], kernel_shape=[2, 2], strides=[2, 2])
    y = b.node("Relu", [y])  # zp 128: becomes Max(q, 128)
    y = b.node("Flatten", [y])
    model = b.model([("x", [2, 3, 4, 4])], [y])
    feeds = _x([2, 3, 4, 4])
    expected = reference(model, feeds)[0]
    converted, (n,) = _apply(model, int8_passthrough)
    assert n == 3 and ops(converted) == ["QuantizeLinear", "MaxPool", "Max", "Flatten", "DequantizeLinear"]
    np.testing.assert_array_equal(run(converted, feeds)[0], expected)


@pytest.mark.parametrize("value, moved", [(None, True), (0.0, True), (0.5, False)])
def test_int8_passthrough_pads_zeros_with_the_zero_point(value, moved):
    """Keras's ZeroPadding2D before a max pool (ResNet's stem): a Pad of 0.0 pads the integers with the zero point
    (the integer of 0); any other value stays float."""
    b = Builder()
    pads = b.const(np.array([0, 0, 1, 1, 0, 0, 1, 1], np.int64))
    y = b.node("Pad", [b.qdq("x", 0.03, 128), pads, *([] if value is None else [b.const(np.float32(value))])])
    model = b.model([("x", [2, 3, 4, 4])], [b.node("MaxPool", [y], kernel_shape=[3, 3], strides=[2, 2])])
    feeds = _x([2, 3, 4, 4])
    expected = reference(model, feeds)[0]
    converted, (n,) = _apply(model, int8_passthrough)
    assert n == (2 if moved else 0)
    if moved:
        assert ops(converted) == ["QuantizeLinear", "Pad", "MaxPool", "DequantizeLinear"]
    np.testing.assert_array_equal(run(converted, feeds)[0], expected)


def test_int8_passthrough_splits_and_slices_on_the_integers():
    """A channel split (ShuffleNet's chunk) and a slice move integers: each Split output gets its own DQ."""
    b = Builder()
    x = b.qdq("x", 0.03, 128)
    b.nodes.append(onnx.helper.make_node("Split", [x, b.const(np.array([2, 2], np.int64))], ["a", "c"], axis=1,
                                         name="split"))
    s = b.node("Slice", ["c", b.const(np.array([1], np.int64)), b.const(np.array([3], np.int64)),
                         b.const(np.array([2], np.int64))])
    model = b.model([("x", [2, 4, 4, 4])], ["a", s])
    feeds = _x([2, 4, 4, 4])
    expected = reference(model, feeds)
    converted, (n,) = _apply(model, int8_passthrough)
    # the DQ of the split part the Slice read went with it
    assert n == 2 and ops(converted) == ["QuantizeLinear", "Split", "DequantizeLinear", "Slice", "DequantizeLinear"]
    for got, want in zip(run(converted, feeds), expected):
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("mode, moved", [("nearest", True), ("linear", False)])
def test_int8_passthrough_moves_a_nearest_resize_onto_the_integers(mode, moved):
    """A detector's nearest upsampling (YOLO's neck) selects input values: it runs on the integers, the values the
    same; a linear Resize computes new ones and stays where it is."""
    b = Builder()
    y = b.node("Resize", [b.qdq("x", 0.03, 128), "", b.const(np.array([1, 1, 2, 2], np.float32))], mode=mode)
    model = b.model([("x", [1, 3, 4, 4])], [y])
    feeds = _x([1, 3, 4, 4])
    converted, (n,) = _apply(model, int8_passthrough)
    assert n == int(moved) and (ops(converted).index("Resize") < ops(converted).index("DequantizeLinear")) == moved
    np.testing.assert_array_equal(run(converted, feeds)[0], reference(model, feeds)[0])


def test_batchnorm_on_a_quantized_activation_becomes_an_exact_depthwise_conv():
    """A pre-activation BatchNorm: its factor held exactly as +-64 with per-channel scale |a| / 64 (a negative and a
    zero factor too), its shift as the bias; then DQ -> Conv -> Relu -> Q converts like any conv."""
    b = Builder()
    c = 4
    gamma = np.array([1.5, -0.7, 0.0, 2.0], np.float32)
    beta, mean = np.array([0.1, -0.2, 0.3, 0.0], np.float32), np.array([0.05, 0.1, -0.1, 0.2], np.float32)
    var = np.array([1.0, 0.5, 2.0, 0.25], np.float32)
    y = b.node("BatchNormalization", [b.qdq("x", 0.03, 128), b.const(gamma), b.const(beta), b.const(mean),
                                      b.const(var)], epsilon=1e-5)
    y = b.qdq(b.node("Relu", [y]), 0.02, 0)
    model = b.model([("x", [2, c, 3, 3])], [y])
    feeds = _x([2, c, 3, 3])
    expected = reference(model, feeds)[0]
    converted, (n,) = _apply(model, batchnorm_to_conv)
    assert n == 1 and "BatchNormalization" not in ops(converted) and "Conv" in ops(converted)
    np.testing.assert_allclose(run(converted, feeds)[0], expected, atol=1e-6)
    integer, _ = _apply(converted, conv_to_qlinearconv)
    assert "QLinearConv" in ops(integer)
    assert np.abs(run(integer, feeds)[0] - expected).max() <= 0.02 + 1e-6  # within one output step


@pytest.mark.parametrize("layout", ["channels last", "channels first"])
def test_a_per_channel_affine_on_a_quantized_activation_becomes_a_batchnorm(layout):
    """tf2onnx's inference BatchNorm (``Mul`` then ``Add`` by per-channel constants) on a quantized activation: a
    BatchNormalization computing exactly ``x * a + b`` (channels last: the integers transposed in, the ReLU and the
    QuantizeLinear after it moved inside, the integers transposed back), then a depthwise QLinearConv like any
    pre-activation BatchNorm, within an output step."""
    b = Builder()
    c = 4
    last = layout == "channels last"
    a = np.array([1.5, -0.7, 0.0, 2.0], np.float32)
    shift = np.array([0.1, -0.2, 0.3, 0.0], np.float32)
    shape = [2, 3, 3, c] if last else [2, c, 3, 3]
    y = b.node("Mul", [b.qdq("x", 0.03, 128), b.const(a if last else a.reshape(c, 1, 1))])
    y = b.node("Add", [y, b.const(shift if last else shift.reshape(c, 1, 1))])
    model = b.model([("x", shape)], [b.qdq(b.node("Relu", [y]), 0.02, 0)])
    feeds = _x(shape)
    expected = reference(model, feeds)[0]
    converted, (n, convs) = _apply(model, affine_to_batchnorm, batchnorm_to_conv)
    assert n == 1 and convs == 1 and not {"Mul", "Add", "BatchNormalization"} & set(ops(converted))
    assert ops(converted).count("Transpose") == (2 if last else 0)
    # the same numbers, but for a sum an FMA rounds once where Mul and Add round twice: a step off at a boundary
    steps = np.abs(run(converted, feeds)[0] - expected) / 0.02
    assert steps.max() <= 1 + 1e-3 and np.median(steps) == 0
    integer, _ = _apply(converted, conv_to_qlinearconv)
    assert "QLinearConv" in ops(integer) and "Conv" not in ops(integer)
    assert np.abs(run(integer, feeds)[0] - expected).max() <= 0.02 + 1e-6  # within one output step


def test_a_channels_last_affine_without_a_quantize_after_stays_as_it_is():
    """Channels last, the result read by something other than a QuantizeLinear (after the ReLU): no conv can take
    it, so the Mul and Add stay (and the converter names them)."""
    b = Builder()
    y = b.node("Mul", [b.qdq("x", 0.03, 128), b.const(np.array([1.5, 2.0], np.float32))])
    y = b.node("Add", [y, b.const(np.array([0.1, 0.2], np.float32))])
    model = b.model([("x", [1, 2, 2, 2])], [b.node("Sigmoid", [b.node("Relu", [y])])])
    converted, (n,) = _apply(model, affine_to_batchnorm)
    assert n == 0 and {"Mul", "Add"} <= set(ops(converted))


def test_int8_passthrough_zero_case():
    b = Builder()
    y = b.node("Sigmoid", [b.qdq("x", 0.03, 128)])
    model = b.model([("x", [1, 4])], [y])
    _, (n,) = _apply(model, int8_passthrough)
    assert n == 0


def test_remove_redundant_qdq():
    b = Builder()
    s, z = b.const(np.float32(0.03)), b.const(np.uint8(128))
    q1 = b.node("QuantizeLinear", ["x", s, z])
    q2 = b.node("QuantizeLinear", [b.node("DequantizeLinear", [q1, s, z]), s, z])
    model = b.model([("x", [1, 4])], [b.node("DequantizeLinear", [q2, s, z])])
    converted, (n,) = _apply(model, remove_redundant_qdq)
    assert n == 1 and ops(converted) == ["QuantizeLinear", "DequantizeLinear"]
    _, (m,) = _apply(converted, remove_redundant_qdq)
    assert m == 0


@pytest.mark.parametrize("largest, factor", [(8, 8), (30, 2), (100, 1)])
def test_finer_weight_grids_puts_a_small_weight_on_a_finer_grid_for_its_bias(largest, factor):
    """A conv with 4-bit-range weights and a float bias between its int32 steps (a BatchNorm folded in): the weights
    times the largest power of two that keeps them within +-64, the scale divided by it (the same values bit for bit),
    so the bias rounds on a grid as much finer; weights beyond +-32 stay as they are."""
    b = Builder()
    q = np.clip(b.rng.integers(-largest, largest + 1, (4, 3, 3, 3)), -127, 127).astype(np.int8)
    q[0, 0, 0, 0] = largest
    scale = np.array([0.02, 0.03, 0.025, 0.05], np.float32)
    w = b.node("DequantizeLinear", [b.const(q), b.const(scale), b.const(np.zeros(4, np.int8))], axis=0)
    y = b.node("Conv", [b.qdq("x", 0.03, 128), w, b.const(np.array([0.0131, -0.2, 0.05, 0.3], np.float32))],
               pads=[1, 1, 1, 1])
    model = b.model([("x", [1, 3, 5, 5])], [y])
    feeds = _x([1, 3, 5, 5])
    converted, (n,) = _apply(model, finer_weight_grids)
    assert n == (factor > 1)
    weights = [onnx.numpy_helper.to_array(t) for t in converted.graph.initializer if t.data_type == onnx.TensorProto.INT8
               and t.dims == [4, 3, 3, 3]]
    assert len(weights) == 1 and np.array_equal(weights[0], q * factor) and np.abs(weights[0]).max() <= 64 or n == 0
    np.testing.assert_array_equal(run(converted, feeds)[0], reference(model, feeds)[0])


def test_float16_to_float32_computes_a_float16_qdq_model_in_float32():
    """ModelOpt's ONNX quantizer at its default: float16 scales and constants behind a Cast of the float32 input, a
    float16 output. Every constant becomes float32 (the same values), the Cast a float32 one, the output keeps its
    declared float16 through a Cast of its own; the integers are the same."""
    b = Builder()
    half = b.node("Cast", ["x"], to=onnx.TensorProto.FLOAT16)
    s, z = b.const(np.float16(0.03)), b.const(np.uint8(128))
    y = b.node("Mul", [b.node("DequantizeLinear", [b.node("QuantizeLinear", [half, s, z]), s, z]),
                       b.const(np.float16(1.5))])
    model = b.model([("x", [2, 4])], [y])
    model.graph.output[0].type.tensor_type.elem_type = onnx.TensorProto.FLOAT16
    model.opset_import[0].version = 19  # float16 scales
    feeds = _x([2, 4])
    findings = Findings()
    converted, (n,) = _apply(model, float16_to_float32, findings=findings)
    assert n == 4 and findings.notes and "float16" in findings.notes[0]  # 2 constants, 2 Casts
    assert not [t.name for t in converted.graph.initializer if t.data_type == onnx.TensorProto.FLOAT16]
    assert converted.graph.output[0].type.tensor_type.elem_type == onnx.TensorProto.FLOAT16
    got, want = run(converted, feeds)[0], reference(model, feeds)[0]
    assert got.dtype == np.float16
    np.testing.assert_allclose(got.astype(np.float32), want.astype(np.float32), rtol=1e-3)


def test_merge_twin_qdq_keeps_one_quantizer_per_tensor_and_grid():
    """A Q/DQ pair per reader (quantize_static's ``DedicatedQDQPair``): the twins go, both readers read one pair, the
    values stay; a quantizer on another grid (or with other attributes) is no twin and stays."""
    b = Builder()
    s, z = b.const(np.float32(0.03)), b.const(np.uint8(128))
    twin_s, twin_z = b.const(np.float32(0.03)), b.const(np.uint8(128))  # equal constants under other names
    first = b.node("DequantizeLinear", [b.node("QuantizeLinear", ["x", s, z]), s, z])
    second = b.node("DequantizeLinear", [b.node("QuantizeLinear", ["x", twin_s, twin_z]), twin_s, twin_z])
    other = b.qdq("x", 0.05, 128)
    model = b.model([("x", [2, 4])], [b.node("Add", [first, second]), b.node("Mul", [first, other])])
    feeds = _x([2, 4])
    converted, (n,) = _apply(model, merge_twin_qdq)
    assert n == 2 and ops(converted).count("QuantizeLinear") == 2 and ops(converted).count("DequantizeLinear") == 2
    add = next(node for node in converted.graph.node if node.op_type == "Add")
    assert add.input[0] == add.input[1]
    for got, want in zip(run(converted, feeds), reference(model, feeds)):
        np.testing.assert_array_equal(got, want)
    _, (m,) = _apply(converted, merge_twin_qdq)
    assert m == 0


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


def test_bias_to_int32_for_qdq_format():
    model = _conv_graph()
    feeds = _x([2, 3, 6, 6])
    expected = reference(model, feeds)[0]
    converted, (n, _) = _apply(model, bias_to_int32, uint8_weights)
    assert n == 1 and ops(converted).count("DequantizeLinear") == 4
    assert np.abs(run(converted, feeds)[0] - expected).max() <= 0.02 + 1e-6


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


def _integer_weights(model):
    """The dtype of each weight that a Conv-like op multiplies: the constant behind a QDQ weight, or the
    integer weight input of QLinearConv / QGemm / MatMulIntegerToFloat."""
    inits = {t.name: t for t in model.graph.initializer}
    producer = {o: n for n in model.graph.node for o in n.output}
    index = {"Conv": 1, "Gemm": 1, "MatMul": 1, "QLinearConv": 3, "QGemm": 3, "MatMulIntegerToFloat": 1}
    kinds = []
    for node in model.graph.node:
        if node.op_type in index:
            name = node.input[index[node.op_type]]
            if name in producer and producer[name].op_type == "DequantizeLinear":
                name = producer[name].input[0]
            if name in inits:
                kinds.append(onnx.helper.tensor_dtype_to_np_dtype(inits[name].data_type))
    return kinds


def _gemm_graph():
    b = Builder()
    h = b.node("Gemm", [b.qdq("x", 0.05, 120), b.weight((16, 8)), b.const(np.zeros(16, np.float32) + 0.1)], transB=1)
    return b.model([("x", [5, 8])], [b.qdq(h, 0.04, 0)]), [5, 8]


def _matmul_graph():
    b = Builder()
    y = b.node("MatMul", [b.qdq("x", 0.05, 128), b.weight((8, 6), axis=1)])
    return b.model([("x", [2, 3, 8])], [b.qdq(y, 0.05, 128)]), [2, 3, 8]


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


def test_conv_with_per_tensor_weight_scale():
    b = Builder()
    y = b.node("Conv", [b.qdq("x", 0.03, 128), b.weight((4, 3, 3, 3), per_channel=False)], pads=[1, 1, 1, 1])
    model = b.model([("x", [1, 3, 5, 5])], [b.qdq(y, 0.05, 120)])
    feeds = _x([1, 3, 5, 5])
    expected = reference(model, feeds)[0]
    converted, (n,) = _apply(model, conv_to_qlinearconv)
    assert n == 1 and np.abs(run(converted, feeds)[0] - expected).max() <= 0.05 + 1e-6


def _two_convs(dead=(1, 3), also_output=False):
    """x -> Conv(4 filters, those in ``dead`` zero with their bias) -> Relu -> QDQ -> Conv(2) -> QDQ."""
    b = Builder()
    w = b.weight((4, 3, 3, 3))
    q = next(t for t in b.inits if t.name == b.nodes[-1].input[0])
    values = onnx.numpy_helper.to_array(q).copy()
    bias = b.rng.standard_normal(4).astype(np.float32) * 0.1
    values[list(dead)] = 0
    bias[list(dead)] = 0
    q.CopyFrom(onnx.numpy_helper.from_array(values, q.name))
    y = b.node("Relu", [b.node("Conv", [b.qdq("x", 0.03, 128), w, b.const(bias, "bias")], pads=[1, 1, 1, 1])])
    y = b.qdq(y, 0.02, 0)
    z = b.qdq(b.node("Conv", [y, b.weight((2, 4, 1, 1))]), 0.05, 100)
    return b.model([("x", [2, 3, 6, 6])], [z] + ([y] if also_output else []))


def _thin_every_channel(g):
    return thin_channels(g, block=1)


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


def test_fold_weight_transposes_lets_a_3d_linear_become_integer():
    b = Builder()
    a = b.qdq("x", 0.05, 128)
    w_t = b.node("Transpose", [b.weight((6, 8), axis=0)], perm=[1, 0])  # torch's Linear on [batch, tokens, hidden]
    y = b.node("Add", [b.node("MatMul", [a, w_t]), b.const(np.full(6, 0.2, np.float32))])
    model = b.model([("x", [2, 3, 8])], [b.qdq(y, 0.05, 128)])
    feeds = _x([2, 3, 8])
    expected = reference(model, feeds)[0]
    assert _apply(model, gemm_to_qgemm)[1] == [0]  # the transpose hides the weight
    converted, (n, m) = _apply(model, fold_weight_transposes, gemm_to_qgemm)
    assert (n, m) == (1, 1) and "Transpose" not in ops(converted) and "MatMulIntegerToFloat" in ops(converted)
    np.testing.assert_allclose(run(converted, feeds)[0], expected, atol=0.05 + 1e-6)


def test_fold_weight_transposes_zero_case_an_activation_transpose_stays():
    b = Builder()
    y = b.node("Transpose", [b.qdq("x", 0.05, 128)], perm=[0, 2, 1])
    model = b.model([("x", [2, 3, 4])], [y])
    converted, (n,) = _apply(model, fold_weight_transposes)
    assert n == 0 and "Transpose" in ops(converted)


def _depthwise_as_tf2onnx_writes_it(new_shape=(3, 3, 1, 4)):
    """tf2onnx's Keras DepthwiseConv2D: the [h, w, channels, 1] kernel (per channel on axis 2), reshaped to
    ``new_shape`` and transposed to ONNX's [channels, 1, h, w], in a grouped Conv between QDQ activations."""
    b = Builder()
    kernel = b.node("Reshape", [b.weight((3, 3, 4, 1), axis=2), b.const(np.array(new_shape, np.int64))])
    conv = b.node("Conv", [b.qdq("x", 0.05, 128), b.node("Transpose", [kernel], perm=[3, 2, 0, 1])], group=4,
                  pads=[1, 1, 1, 1])
    return b.model([("x", [2, 4, 6, 6])], [b.qdq(conv, 0.05, 128)])


def test_fold_weight_reshapes_lets_a_keras_depthwise_conv_become_integer():
    model = _depthwise_as_tf2onnx_writes_it()
    feeds = _x([2, 4, 6, 6])
    expected = reference(model, feeds)[0]
    assert _apply(model, fold_weight_transposes, conv_to_qlinearconv)[1] == [0, 0]  # the reshape hides the weight
    converted, counts = _apply(model, fold_weight_reshapes, fold_weight_transposes, conv_to_qlinearconv)
    assert counts == [1, 1, 1] and ops(converted) == ["QuantizeLinear", "QLinearConv", "DequantizeLinear"]
    np.testing.assert_allclose(run(converted, feeds)[0], expected, atol=0.05 + 1e-6)


def test_fold_weight_reshapes_zero_case_a_reshape_that_mixes_channels_stays():
    model = _depthwise_as_tf2onnx_writes_it(new_shape=(3, 4, 3, 1))  # channels no longer on an axis of their own
    converted, (n,) = _apply(model, fold_weight_reshapes)
    assert n == 0 and "Reshape" in ops(converted)


@pytest.mark.parametrize("axis, per_channel", [(0, True), (1, True), (0, False)])
def test_gather_int8_tables_gathers_integer_rows(axis, per_channel):
    b = Builder()
    table = b.weight((50, 6), axis=axis, per_channel=per_channel)
    y = b.node("Gather", [table, "ids"], axis=0)
    graph_inputs = [onnx.helper.make_tensor_value_info("ids", onnx.TensorProto.INT64, [2, 5])]
    model = b.model([], [y])
    model.graph.input.extend(graph_inputs)
    feeds = {"ids": np.random.default_rng(0).integers(0, 50, (2, 5))}
    expected = reference(model, feeds)[0]
    converted, (n,) = _apply(model, gather_int8_tables)
    assert n == 1
    gathers = [x for x in converted.graph.node if x.op_type == "Gather"]
    int8_tables = {t.name for t in converted.graph.initializer if t.data_type == onnx.TensorProto.INT8}
    assert gathers[0].input[0] in int8_tables  # the integer table is read, no float copy exists
    assert not [t for t in converted.graph.initializer if t.data_type == onnx.TensorProto.FLOAT and t.dims[:1] == [50]
                and len(t.dims) == 2 and t.dims[1] == 6]
    np.testing.assert_array_equal(run(converted, feeds)[0], expected)


def test_gather_int8_tables_zero_case_a_gather_along_another_axis():
    b = Builder()
    y = b.node("Gather", [b.weight((50, 6)), b.const(np.array([0, 2]))], axis=1)
    model = b.model([], [y])
    assert _apply(model, gather_int8_tables)[1] == [0]


@pytest.mark.parametrize("batch", [1, "batch"])  # static shapes: onnxruntime fuses MatMul + Add into a Gemm first
def test_bias_to_int32_lets_onnxruntime_fuse_a_3d_linear(batch, tmp_path):
    b = Builder()
    a = b.qdq("x", 0.05, 128)
    y = b.node("Add", [b.node("MatMul", [a, b.weight((8, 6), axis=1)]), b.const(np.linspace(-1, 1, 6, dtype=np.float32))])
    model = b.model([("x", [batch, 3, 8])], [y])
    feeds = _x([1, 3, 8])
    expected = reference(model, feeds)[0]
    converted, (n, _) = _apply(model, bias_to_int32, uint8_weights)  # as format="qdq" runs them
    assert n == 1
    np.testing.assert_allclose(run(converted, feeds)[0], expected, atol=1e-3)  # the bias rounded to s_x * s_w
    options = ort.SessionOptions()
    options.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    ort.InferenceSession(converted.SerializeToString(), options, providers=["CPUExecutionProvider"])
    fused = ops(onnx.load(str(tmp_path / "optimized.onnx")))
    assert {"MatMul", "Gemm"}.isdisjoint(fused) and {"QGemm", "MatMulIntegerToFloat"} & set(fused), fused


@pytest.mark.parametrize("scale, zp, high, expected", [
    (6 / 255, 0, 6.0, []),  # a ReLU6 after an op whose range already stops at 6: nothing left
    (0.1, 128, 6.0, ["Max", "Min"]),  # both bounds on the grid: clamps on the integers
    (0.1, 128, 6.05, None),  # 6.05 lies between grid points: the floats would round differently, stays float
])
def test_int8_passthrough_clip(scale, zp, high, expected):
    b = Builder()
    y = b.node("Clip", [b.qdq("x", scale, zp), b.const(np.float32(0)), b.const(np.float32(high))])
    model = b.model([("x", [2, 50])], [y])
    feeds = {"x": np.linspace(-12, 12, 100, dtype=np.float32).reshape(2, 50)}
    expected_out = reference(model, feeds)[0]
    converted, (n,) = _apply(model, int8_passthrough)
    if expected is None:
        assert n == 0 and "Clip" in ops(converted)
        return
    assert n == 1 and "Clip" not in ops(converted) and [o for o in ops(converted) if o in ("Max", "Min")] == expected
    np.testing.assert_array_equal(run(converted, feeds)[0], expected_out)


@pytest.mark.parametrize("scales, zp, expected_op", [((0.05, 0.05), 128, "Concat"), ((0.03, 0.08), 0, "QLinearConcat"),
                                                     ((0.05, 0.05), 0, "QLinearConcat")])
def test_concat_to_qlinear(scales, zp, expected_op):
    b = Builder()
    x = b.qdq("x", scales[0], 128)
    y = b.qdq(b.node("Relu", ["x"]), scales[1], zp)
    out = b.qdq(b.node("Concat", [x, y], axis=1), 0.05, 128)
    model = b.model([("x", [2, 3, 4])], [out])
    feeds = {"x": np.linspace(-4, 4, 24, dtype=np.float32).reshape(2, 3, 4)}
    expected = reference(model, feeds)[0]
    converted, (n,) = _apply(model, concat_to_qlinear)
    assert n == 1 and expected_op in ops(converted) and ops(converted).count("Concat") == (expected_op == "Concat")
    np.testing.assert_allclose(run(converted, feeds)[0], expected, atol=0.05 * 1.0001)  # at most one output step
    if expected_op == "Concat":
        np.testing.assert_array_equal(run(converted, feeds)[0], expected)


def test_concat_to_qlinear_zero_case_a_float_input():
    b = Builder()
    out = b.qdq(b.node("Concat", [b.qdq("x", 0.05, 128), "x"], axis=1), 0.05, 128)
    model = b.model([("x", [2, 3])], [out])
    assert _apply(model, concat_to_qlinear)[1] == [0]


@pytest.mark.parametrize("pads, value, folds", [
    ([0, 0, 0, 1, 0, 0, 1, 2], 0.0, True),     # TF-style "same": more after than before
    ([0, 0, 1, 1, 0, 0, 1, 1], 0.5, False),    # not zeros: not the conv's padding
    ([1, 0, 0, 0, 0, 0, 0, 0], 0.0, False),    # a batch pad is no conv padding
    ([0, 0, -1, 0, 0, 0, 0, 0], 0.0, False),   # a negative pad crops
])
@pytest.mark.parametrize("conv_padding", [{"pads": [1, 0, 0, 1]}, {"auto_pad": "VALID"}])
def test_fold_pads_into_convs(pads, value, folds, conv_padding):
    """Hugging Face's EfficientNet writes ``Pad -> Conv(auto_pad=VALID)``, its pads computed by a chain of ops
    (folded to a constant before this pass)."""
    b = Builder()
    x = b.qdq("x", 0.05, 128)
    computed = b.node("Cast", [b.node("Concat", [b.const(np.array(pads[:4], np.float32)),
                                                 b.const(np.array(pads[4:], np.float32))], axis=0)], to=7)
    padded = b.node("Pad", [x, computed, b.const(np.float32(value))])
    y = b.qdq(b.node("Conv", [padded, b.weight([4, 3, 3, 3])], **conv_padding), 0.1, 128)
    model = b.model([("x", [1, 3, 6, 6])], [y])
    feeds = _x([1, 3, 6, 6])
    expected = reference(model, feeds)[0]
    converted, (_, _, n, m) = _apply(model, constants_to_initializers, fold_constants, fold_pads_into_convs,
                                     conv_to_qlinearconv)
    assert n == folds and ("Pad" in ops(converted)) != folds
    if folds:
        assert m == 1 and "QLinearConv" in ops(converted)
    np.testing.assert_allclose(run(converted, feeds)[0], expected, atol=0.1 * 1.0001)  # at most one output step


@pytest.mark.parametrize("zp, clip_max, removed", [(0, None, True), (128, None, False), (0, 6.0, True),
                                                   (0, 2.0, False)])
def test_remove_noop_clamps(zp, clip_max, removed):
    b = Builder()
    x = b.qdq("x", 6.0 / 255, zp)  # ReLU6's grid: 0 .. 6
    act = b.node("Relu", [x]) if clip_max is None else b.node("Clip", [x, b.const(np.float32(0)),
                                                                       b.const(np.float32(clip_max))])
    y = b.qdq(b.node("Conv", [act, b.weight([4, 3, 1, 1])]), 0.1, 128)
    model = b.model([("x", [1, 3, 4, 4])], [y])
    feeds = {"x": np.linspace(-8, 8, 48, dtype=np.float32).reshape(1, 3, 4, 4)}
    expected = reference(model, feeds)[0]
    converted, (n,) = _apply(model, remove_noop_clamps)
    assert n == removed and (("Relu" in ops(converted)) or ("Clip" in ops(converted))) != removed
    np.testing.assert_array_equal(run(converted, feeds)[0], expected)


def test_the_graph_layer_keeps_names_and_leaves_the_input_model_alone():
    """A node standing in for another keeps the replaced tensor's name (verification compares tensors by name),
    a graph output keeps its name when its producer goes, dead nodes go, and the input ModelProto is untouched."""
    model = _conv_graph(relu=True, out_zp=0)
    before = model.SerializeToString()
    g = Graph(onnx.shape_inference.infer_shapes(model))
    q = next(n for n in g.each("QuantizeLinear") if getattr(g.producer(n.inputs[0]), "op_type", "") == "Relu")
    name = q.outputs[0].name
    assert conv_to_qlinearconv(g) == 1
    (conv,) = g.each("QLinearConv")
    assert conv.outputs[0].name == name and g.rank(conv.outputs[0]) == 4
    output = g.graph.outputs[0]
    dq = g.producer(output)
    relu = g.add_node("Relu", [dq.inputs[0]], name="stand_in", replaces=output)
    assert g.graph.outputs[0] is relu.outputs[0] and relu.outputs[0].name == model.graph.output[0].name
    assert g.uses(dq.outputs[0]) == 0
    assert g.remove_dead() == 3  # that DequantizeLinear, and the input's and weight's the QLinearConv no longer reads
    written = g.commit()
    onnx.checker.check_model(written)
    assert [o.name for o in written.graph.output] == [o.name for o in model.graph.output]
    assert model.SerializeToString() == before


def test_the_pipeline_declares_every_pass_module_once_in_order():
    """recal_onnx.pipeline is the one place the converter's order is written: every module in passes/ is one pass of
    it, named as its module (the name the conversion's report counts rewrites under), the QOperator passes repeat
    together, and the format decides which steps run."""
    import pkgutil

    import recal_onnx.passes as passes_package
    from recal_onnx.pipeline import PIPELINE, READERS, Options

    declared = {p.__module__.rsplit(".", 1)[1] for step in PIPELINE for p in (*step.passes, *READERS)}
    modules = {m.name for m in pkgutil.iter_modules(passes_package.__path__)}
    assert modules - declared == set(), modules - declared
    passes = {p for step in PIPELINE for p in step.passes} | set(READERS)
    assert [p.__name__ for p in passes if p.__module__.rsplit(".", 1)[1] != p.__name__] == []
    qoperator = [s for s in PIPELINE if s.when(Options(format="qoperator")) and not s.when(Options(format="qdq"))]
    assert len(qoperator) == 1 and qoperator[0].repeat and conv_to_qlinearconv in qoperator[0].passes
    assert not any(bias_to_int32 in s.passes for s in PIPELINE if s.when(Options(format="qoperator")))


def _weight_only_graph(gemm: bool, group: int, n: int = 24, k: int = 64, bits: int = 4):
    """``x -> MatMul(Transpose(Reshape(DQ(q [n*k/group, group], s, axis 0))))`` + bias: recal's weight-only export
    (``Gemm(transB=1)`` for a 2-D input); integers within +-1 (2 bits: ternary), +-7 (4 bits) or +-127."""
    b = Builder()
    levels = {2: 1, 4: 7, 8: 127}[bits]
    q = b.rng.integers(-levels, levels + 1, (n * k // group, group)).astype(np.int8)
    scale = b.rng.uniform(0.01, 0.05, n * k // group).astype(np.float32)
    dq = b.node("DequantizeLinear", [b.const(q, "w"), b.const(scale, "ws"), b.const(np.zeros(scale.size, np.int8))],
                axis=0)
    w = b.node("Reshape", [dq, b.const(np.array([n, k], np.int64))])
    bias = b.const(b.rng.standard_normal(n).astype(np.float32))
    if gemm:
        y = b.node("Gemm", ["x", w, bias], transB=1)
    else:
        y = b.node("Add", [b.node("MatMul", ["x", b.node("Transpose", [w], perm=[1, 0])]), bias])
    return b.model([("x", [None, 3, k] if not gemm else [None, k])], [y])


@pytest.mark.parametrize("gemm, group, bits", [(False, 32, 4), (True, 16, 4), (False, 64, 8), (False, 16, 2),
                                               (True, 64, 2)],
                         ids=["matmul-g32-int4", "gemm-g16-int4", "per-channel-int8", "matmul-g16-ternary",
                              "gemm-per-channel-ternary"])
def test_matmul_to_nbits(gemm, group, bits):
    """A weight-only layer becomes one MatMulNBits (its bias Add folded in) with the same values, run by a default
    and an unoptimized session; a MatMul whose input is a dequantized activation (W8A8) is not touched."""
    from recal_onnx.passes.matmul_to_nbits import matmul_to_nbits

    model = _weight_only_graph(gemm, group, bits=bits)
    feeds = _x([5, 3, 64] if not gemm else [5, 64])
    expected = reference(model, feeds)[0]
    converted, (n,) = _apply(model, matmul_to_nbits)
    assert n == 1 and ops(converted) == ["MatMulNBits"]
    node = converted.graph.node[0]
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    assert attrs["bits"] == bits and attrs["block_size"] == (group if group < 64 else 64) and attrs["N"] == 24
    packed = onnx.numpy_helper.to_array(next(t for t in converted.graph.initializer if t.name == node.input[1]))
    assert packed.shape == (24, 64 // attrs["block_size"], attrs["block_size"] * bits // 8)  # 8 / bits values a byte
    for level in (None, ort.GraphOptimizationLevel.ORT_DISABLE_ALL):
        np.testing.assert_allclose(run(converted, feeds, level=level)[0], expected, rtol=1e-5, atol=1e-5)


def test_matmul_to_nbits_leaves_quantized_inputs_and_odd_groups():
    from recal_onnx.passes.matmul_to_nbits import matmul_to_nbits

    b = Builder()
    x = b.qdq("x", 0.05, 128)
    y = b.node("MatMul", [x, b.weight([16, 8], axis=1)])
    _, (n,) = _apply(b.model([("x", [2, 16])], [y]), matmul_to_nbits)
    assert n == 0
    findings = Findings()
    g = Graph(onnx.shape_inference.infer_shapes(_weight_only_graph(False, 8, k=64)))  # groups of 8: no block size
    assert matmul_to_nbits(g, findings=findings) == 0 and list(findings.kept_float.values())[0][0] == "MatMul"


@pytest.mark.parametrize("group", [16, 48], ids=["groups-of-16", "per-row"])
def test_gather_int4_tables(group):
    """An int4 table (recal's grouped rows, or one scale a row) is gathered packed by GatherBlockQuantized, the same
    rows; an int8 table is left to the int8 gather."""
    from recal_onnx.passes.gather_int4_tables import gather_int4_tables

    for levels, expected in ((7, 1), (127, 0)):
        b = Builder()
        vocab, width = 10, 48
        q = b.rng.integers(-levels, levels + 1, (vocab * width // group, group)).astype(np.int8)
        scale = b.rng.uniform(0.01, 0.05, q.shape[0]).astype(np.float32)
        dq = b.node("DequantizeLinear", [b.const(q, "w"), b.const(scale, "ws"),
                                         b.const(np.zeros(scale.size, np.int8))], axis=0)
        table = b.node("Reshape", [dq, b.const(np.array([vocab, width], np.int64))])
        y = b.node("Gather", [table, "ids"], axis=0)
        graph = onnx.helper.make_graph(b.nodes, "t", [onnx.helper.make_tensor_value_info("ids", onnx.TensorProto.INT64,
                                                                                          [2, 3])],
                                       [onnx.helper.make_tensor_value_info(y, onnx.TensorProto.FLOAT, None)], b.inits)
        model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 17)])
        feeds = {"ids": np.array([[0, 9, 3], [3, 3, 1]], np.int64)}
        want = reference(model, feeds)[0]
        converted, (n,) = _apply(model, gather_int4_tables)
        assert n == expected
        if expected:
            assert ops(converted) == ["GatherBlockQuantized"]
            for level in (None, ort.GraphOptimizationLevel.ORT_DISABLE_ALL):
                np.testing.assert_array_equal(run(converted, feeds, level=level)[0], want)


def _attention_graph(dead_head=1, heads_const=True, norm=None):
    """x[1, 5, 8] -> Q, K, V (MatMul + bias Add, 2 heads of 4) -> Reshape -> Transpose -> softmax(Q Kᵀ) V ->
    Transpose -> Reshape -> Q/DQ -> MatMul(Wo); head ``dead_head``'s value columns and bias are zero. ``norm``:
    the queries and keys RMS-normalized over ``"each head"`` (Qwen3's q_norm, after the Reshape) or ``"all heads"``
    (before it)."""
    b = Builder()

    def rms(x, width):  # x / sqrt(mean(x^2, last axis) + eps) * weight
        mean = b.node("ReduceMean", [b.node("Pow", [x, b.const(np.float32(2))])], axes=[-1], keepdims=1)
        scale = b.node("Reciprocal", [b.node("Sqrt", [b.node("Add", [mean, b.const(np.float32(1e-6))])])])
        weight = b.rng.uniform(0.5, 1.5, width).astype(np.float32)
        return b.node("Mul", [b.const(weight, "g"), b.node("Mul", [x, scale])])

    def projection(zero_head):
        w = b.weight((8, 8), axis=1)
        init = next(i for i in reversed(b.inits) if i.name[0] == "w" and i.name[1:].isdigit())
        bias = b.rng.standard_normal(8).astype(np.float32) * 0.1
        if zero_head is not None:
            values = onnx.numpy_helper.to_array(init).copy()
            values[:, 4 * zero_head:4 * zero_head + 4] = 0
            init.CopyFrom(onnx.numpy_helper.from_array(values, init.name))
            bias[4 * zero_head:4 * zero_head + 4] = 0
        y = b.node("Add", [b.node("MatMul", ["x", w]), b.const(bias, "b")])
        if norm == "all heads" and zero_head is None:
            y = rms(b.node("Identity", [y]), 8)
        split = b.const(np.array([1, 5, 2 if heads_const else -1, 4], np.int64), "shape")
        y = b.node("Reshape", [y, split])
        return rms(y, 4) if norm == "each head" and zero_head is None else y

    q = b.node("Transpose", [projection(None)], perm=[0, 2, 1, 3])
    k = b.node("Transpose", [projection(None)], perm=[0, 2, 3, 1])
    v = b.node("Transpose", [projection(dead_head)], perm=[0, 2, 1, 3])
    scores = b.node("Mul", [b.node("MatMul", [q, k]), b.const(np.float32(0.5))])
    heads = b.node("MatMul", [b.node("Softmax", [scores], axis=-1), v])
    merged = b.node("Reshape", [b.node("Transpose", [heads], perm=[0, 2, 1, 3]),
                                b.const(np.array([1, 5, 8], np.int64), "shape")])
    out = b.node("MatMul", [b.qdq(merged, 0.02, 128), b.weight((8, 8), axis=1)])
    return b.model([("x", [1, 5, 8])], [out])


@pytest.mark.parametrize("heads_const", [True, False], ids=["head count in the reshape", "-1"])
def test_thin_heads_removes_a_dead_head_from_every_projection(heads_const):
    model = _attention_graph(heads_const=heads_const)
    feeds = _x([1, 5, 8])
    expected = reference(model, feeds)[0]
    thinned, (n,) = _apply(model, thin_heads)
    assert n == 1
    shapes = sorted(onnx.numpy_helper.to_array(t).shape for t in thinned.graph.initializer
                    if onnx.numpy_helper.to_array(t).dtype == np.int8 and onnx.numpy_helper.to_array(t).ndim == 2)
    assert shapes == [(4, 8), (8, 4), (8, 4), (8, 4)]  # Wo loses rows; Wq, Wk, Wv lose columns
    off = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    np.testing.assert_allclose(run(thinned, feeds, level=off)[0], expected, atol=1e-6)  # the removed terms were 0
    # a default session fuses the final QDQ MatMul alike in both: within one output quantum of each other
    assert np.abs(run(thinned, feeds)[0] - run(model, feeds)[0]).max() <= 0.05


@pytest.mark.parametrize("mask", ["value bias alive", "queries and keys dead, values alive"])
def test_thin_heads_keeps_a_head_a_hostile_mask_only_half_kills(mask):
    """Head 1's value weights zero but its value bias not (its output is that bias, not 0); or its query and key
    weights and biases zero with its values alive (uniform attention: the mean of its values). Neither head is dead:
    nothing is removed and the model computes what it did."""
    model = _attention_graph()
    inits = {i.name: i for i in model.graph.initializer}
    adds = [n for n in model.graph.node if n.op_type == "Add"]

    def edit(name, change):
        values = onnx.numpy_helper.to_array(inits[name]).copy()
        change(values)
        inits[name].CopyFrom(onnx.numpy_helper.from_array(values, name))

    edit(adds[2].input[1], lambda v: v.__setitem__(slice(4, 8), 0.3))  # the value bias of head 1
    if mask != "value bias alive":
        dqs = [n for n in model.graph.node if n.op_type == "DequantizeLinear" and n.input[0] in inits
               and tuple(inits[n.input[0]].dims) == (8, 8)]
        for add, dq in zip(adds[:2], dqs[:2]):  # the query and key projections' head 1
            edit(add.input[1], lambda v: v.__setitem__(slice(4, 8), 0))
            edit(dq.input[0], lambda v: v.__setitem__((slice(None), slice(4, 8)), 0))
    feeds = _x([1, 5, 8])
    thinned, (n,) = _apply(model, thin_heads)
    assert n == 0
    off = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    np.testing.assert_array_equal(run(thinned, feeds, level=off)[0], reference(model, feeds)[0])


@pytest.mark.parametrize("norm", ["each head", "all heads"])
def test_thin_heads_follows_a_norm_of_each_heads_queries_not_one_of_all_heads(norm):
    """Qwen3 normalizes each head's queries and keys over the head's own axis: removing a head leaves the others'
    norms as they were. A norm over all heads (before they are split) would change: that attention stays whole."""
    model = _attention_graph(norm=norm)
    feeds = _x([1, 5, 8])
    findings = Findings()
    thinned, (n,) = _apply(model, thin_heads, findings=findings)
    assert n == (1 if norm == "each head" else 0)
    off = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    np.testing.assert_allclose(run(thinned, feeds, level=off)[0], reference(model, feeds)[0], atol=1e-5)
    if norm == "all heads":  # its dead head stays, said: the value layer's 4 zero outputs, and why
        (why,) = findings.heads_kept.values()
        assert why.startswith("4 outputs of the layer making its values are zero, but its queries do not come from")
    else:
        assert findings.heads_kept == {}


def test_a_conversion_names_the_attentions_whose_zero_heads_it_cannot_remove():
    """Nothing silent: an attention the converter cannot follow keeps its zero heads with a ThinningWarning that
    names it and why; one whose heads are all alive is not mentioned."""
    with pytest.warns(ThinningWarning, match=r"1 attention keeps heads that look pruned .*\n  '.*': 4 outputs of "
                                             r"the layer making its values are zero, but its queries do not come"):
        result = quantize_qat_export(_attention_graph(norm="all heads"))
    assert len(result.heads_kept) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error", ThinningWarning)
        assert quantize_qat_export(_attention_graph(dead_head=None, norm="all heads")).heads_kept == {}


def _packed_attention_graph(per_head=False):
    """One MatMul(W[8, 24]) + Add(b) packing Q, K and V of 2 heads of 4 on x[1, 5, 8], as GPT-2's ``c_attn`` (Split
    ([8, 8, 8]) into Q, K, V, then Reshape and Transpose each) or, ``per_head``, as GPT-NeoX's ``query_key_value``
    (Reshape([1, 5, 2, 12]), Transpose, Split([4, 4, 4]) of each head's last axis) -> softmax(Q Kᵀ) V -> Transpose ->
    Reshape -> Q/DQ -> MatMul(Wo). Columns 20 .. 24 are head 1's value in both layouts: zero, with their bias."""
    b = Builder()
    w = b.weight((8, 24), axis=1)
    init = next(i for i in reversed(b.inits) if i.name[0] == "w" and i.name[1:].isdigit())
    values = onnx.numpy_helper.to_array(init).copy()
    values[:, 20:24] = 0
    init.CopyFrom(onnx.numpy_helper.from_array(values, init.name))
    bias = b.rng.standard_normal(24).astype(np.float32) * 0.1
    bias[20:24] = 0
    packed = b.node("Add", [b.node("MatMul", ["x", w]), b.const(bias, "b")])
    if per_head:
        packed = b.node("Transpose", [b.node("Reshape", [packed, b.const(np.array([1, 5, 2, 12], np.int64), "s")])],
                        perm=[0, 2, 1, 3])
    q, k, v = (f"{packed}_{i}" for i in range(3))
    sizes = [4, 4, 4] if per_head else [8, 8, 8]
    b.nodes.append(onnx.helper.make_node("Split", [packed, b.const(np.array(sizes, np.int64), "sizes")], [q, k, v],
                                         axis=-1))
    if per_head:
        k = b.node("Transpose", [k], perm=[0, 1, 3, 2])
    else:
        heads = [b.node("Reshape", [t, b.const(np.array([1, 5, 2, 4], np.int64), "s")]) for t in (q, k, v)]
        q, k, v = (b.node("Transpose", [t], perm=p) for t, p in zip(heads, ([0, 2, 1, 3], [0, 2, 3, 1], [0, 2, 1, 3])))
    out = b.node("MatMul", [b.node("Softmax", [b.node("MatMul", [q, k])], axis=-1), v])
    merged = b.node("Reshape", [b.node("Transpose", [out], perm=[0, 2, 1, 3]),
                                b.const(np.array([1, 5, 8], np.int64), "shape")])
    return b.model([("x", [1, 5, 8])], [b.node("MatMul", [b.qdq(merged, 0.02, 128), b.weight((8, 8), axis=1)])])


@pytest.mark.parametrize("per_head", [False, True], ids=["blocks (GPT-2)", "per head (GPT-NeoX)"])
def test_thin_heads_takes_a_dead_heads_rows_from_a_packed_projection(per_head):
    model = _packed_attention_graph(per_head)
    feeds = _x([1, 5, 8])
    thinned, (n,) = _apply(model, thin_heads)
    assert n == 1
    shapes = sorted(onnx.numpy_helper.to_array(t).shape for t in thinned.graph.initializer
                    if onnx.numpy_helper.to_array(t).dtype == np.int8 and onnx.numpy_helper.to_array(t).ndim == 2)
    assert shapes == [(4, 8), (8, 12)]  # Wo loses rows; the packed W the head's 4 columns of each of Q, K and V
    split = next(n for n in thinned.graph.node if n.op_type == "Split")
    sizes = next(t for t in thinned.graph.initializer if t.name == split.input[1])
    assert onnx.numpy_helper.to_array(sizes).tolist() == [4, 4, 4]  # blocks: 8 each before; per head: unchanged
    off = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    np.testing.assert_allclose(run(thinned, feeds, level=off)[0], run(model, feeds, level=off)[0], atol=1e-6)


def test_thin_heads_zero_rewrites():
    _, (n,) = _apply(_attention_graph(dead_head=None), thin_heads)
    assert n == 0  # every head alive


def _gqa_graph(dead_unit=1):
    """A Llama attention: x[1, 5, 8] -> Q (4 heads of 2), K and V (2 key/value heads) -> Reshape -> Transpose ->
    rotary (``x * cos + cat(-x[.., 1:], x[.., :1]) * sin``) on Q and K -> K and V repeated for 2 query heads each
    (``Unsqueeze -> Expand -> Reshape``, constant shapes holding the head counts) -> softmax(Q Kᵀ) V -> Transpose ->
    Reshape -> Q/DQ -> MatMul(Wo); key/value head ``dead_unit``'s value columns are zero."""
    b = Builder()
    cos = b.const(np.cos(np.arange(10, dtype=np.float32)).reshape(1, 1, 5, 2), "cos")
    sin = b.const(np.sin(np.arange(10, dtype=np.float32)).reshape(1, 1, 5, 2), "sin")

    def projection(heads, zero=None):
        w = b.weight((8, 2 * heads), axis=1)
        if zero is not None:
            init = next(i for i in reversed(b.inits) if i.name[0] == "w" and i.name[1:].isdigit())
            values = onnx.numpy_helper.to_array(init).copy()
            values[:, 2 * zero:2 * zero + 2] = 0
            init.CopyFrom(onnx.numpy_helper.from_array(values, init.name))
        split = b.node("Reshape", [b.node("MatMul", ["x", w]), b.const(np.array([1, 5, heads, 2], np.int64), "s")])
        return b.node("Transpose", [split], perm=[0, 2, 1, 3])

    def rotary(t):
        def part(start, end):
            return b.node("Slice", [t, b.const(np.array([start], np.int64)), b.const(np.array([end], np.int64)),
                                    b.const(np.array([-1], np.int64))])
        half = b.node("Concat", [b.node("Neg", [part(1, 2)]), part(0, 1)], axis=-1)
        return b.node("Add", [b.node("Mul", [t, cos]), b.node("Mul", [half, sin])])

    def repeat(t):
        wide = b.node("Expand", [b.node("Unsqueeze", [t, b.const(np.array([2], np.int64))]),
                                 b.const(np.array([1, 2, 2, 5, 2], np.int64), "e")])
        return b.node("Reshape", [wide, b.const(np.array([1, 4, 5, 2], np.int64), "r")])

    q = rotary(projection(4))
    k = b.node("Transpose", [repeat(rotary(projection(2)))], perm=[0, 1, 3, 2])
    v = repeat(projection(2, dead_unit))
    heads = b.node("MatMul", [b.node("Softmax", [b.node("MatMul", [q, k])], axis=-1), v])
    merged = b.node("Reshape", [b.node("Transpose", [heads], perm=[0, 2, 1, 3]),
                                b.const(np.array([1, 5, 8], np.int64), "shape")])
    out = b.node("MatMul", [b.qdq(merged, 0.02, 128), b.weight((8, 8), axis=1)])
    return b.model([("x", [1, 5, 8])], [out])


def test_thin_heads_removes_a_dead_key_value_head_with_its_query_heads_through_rotary_and_repeat():
    """Grouped-query attention: a unit is a key/value head and the query heads that read it; the rotary embedding
    works within each head, and the repeat's Expand and Reshape shapes are rewritten to the heads left."""
    model = _gqa_graph()
    feeds = _x([1, 5, 8])
    expected = reference(model, feeds)[0]
    thinned, (n,) = _apply(model, thin_heads)
    assert n == 2  # query heads 2 and 3 with key/value head 1
    shapes = sorted(onnx.numpy_helper.to_array(t).shape for t in thinned.graph.initializer
                    if onnx.numpy_helper.to_array(t).dtype == np.int8 and onnx.numpy_helper.to_array(t).ndim == 2)
    assert shapes == [(4, 8), (8, 2), (8, 2), (8, 4)]  # Wo loses rows; Wq two heads' columns, Wk and Wv one head's
    for level in (ort.GraphOptimizationLevel.ORT_DISABLE_ALL, None):
        np.testing.assert_allclose(run(thinned, feeds, level=level)[0], expected, atol=0.05)
    off = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    np.testing.assert_allclose(run(thinned, feeds, level=off)[0], run(model, feeds, level=off)[0], atol=1e-6)
    _, (n,) = _apply(_gqa_graph(dead_unit=None), thin_heads)
    assert n == 0


@pytest.mark.parametrize("form", ["max-min", "min-max", "max", "min", "scalar-first", "crossed"])
def test_minmax_to_clip(form):
    """jax2onnx's ReLU6 (``Max(x, 0) -> Min(., 6)``) and ReLU (``Max(x, 0)``) become the Clip the integer passes fold
    into a conv, in either order and with the constant on either side; bounds that cross (min > max) are two
    one-sided Clips."""
    b = Builder()
    x = b.qdq("x", 0.05, 128)
    y = b.node("Conv", [x, b.weight((4, 3, 1, 1))])
    zero, six = b.const(np.array(0.0, np.float32), "zero"), b.const(np.array([6.0], np.float32), "six")
    if form in ("max-min", "crossed"):
        y = b.node("Min", [b.node("Max", [y, six if form == "crossed" else zero]), zero if form == "crossed" else six])
    elif form == "min-max":
        y = b.node("Max", [b.node("Min", [y, six]), zero])
    elif form == "scalar-first":
        y = b.node("Max", [zero, y])
    else:
        y = b.node(form.capitalize(), [y, zero if form == "max" else six])
    model = b.model([("x", [1, 3, 4, 4])], [b.qdq(y, 0.03, 0)])
    feeds = {"x": np.random.default_rng(0).standard_normal((1, 3, 4, 4)).astype(np.float32) * 8}
    expected = reference(model, feeds)[0]
    converted, (n,) = _apply(model, minmax_to_clip)
    assert n == (2 if form == "crossed" else 1)
    assert "Max" not in ops(converted) and "Min" not in ops(converted) and ops(converted).count("Clip") == n
    np.testing.assert_array_equal(run(converted, feeds)[0], expected)
    if form == "max-min":  # and the ReLU6 tail folds into the integer conv
        integer, _ = _apply(converted, conv_to_qlinearconv)
        assert "Clip" not in ops(integer) and "QLinearConv" in ops(integer)
        assert np.abs(run(integer, feeds)[0] - expected).max() <= 0.03 + 1e-6


@pytest.mark.parametrize("form", ["hard-swish ops", "HardSwish", "hard-sigmoid, int8", "padded", "nodes unsorted",
                                  "read elsewhere", "per channel", "two inputs", "sigmoid alone", "feature map"])
def test_unary_to_table(form):
    """A function of one quantized tensor computed in float before a QuantizeLinear (MobileNetV3's hard-swish as
    Keras's TF export writes it, as ONNX's HardSwish, hard-sigmoid on an int8 grid) becomes a 256-entry table
    looked up with Gather, equal to the float model on every value. Not when a value inside is read elsewhere,
    a constant is per channel, the ops read two quantized tensors, or it is a sigmoid alone (QLinearSigmoid's).
    A zero padding before the QuantizeLinear (ZeroPadding2D's) moves after the table, padding with its zero point.
    The table is right when earlier rewrites left the graph's nodes out of computing order. A feature map (over
    TABLE_MAX values a sample), where onnxruntime's float ops are faster than its lookup, stays float, named."""
    b = Builder()
    dtype, zp = (np.int8, -5) if "int8" in form else (np.uint8, 120)
    x = b.qdq("x", 0.05, zp, dtype)
    c = b.const
    if form == "HardSwish":
        y = b.node("HardSwish", [x])
    elif form == "sigmoid alone":
        y = b.node("Sigmoid", [x])
    elif form == "two inputs":
        y = b.node("Mul", [x, b.qdq("z", 0.02, 128)])
    else:
        three = c(np.array([3.0] if form != "per channel" else [[[3.0]], [[2.0]], [[1.0]]], np.float32))
        gate = b.node("Div", [b.node("Clip", [b.node("Add", [x, three]), c(np.float32(0)), c(np.float32(6))]),
                              c(np.float32(6))])
        y = gate if "hard-sigmoid" in form else b.node("Mul", [x, gate])
    if form == "padded":
        y = b.node("Pad", [y, c(np.array([0, 0, 1, 1, 0, 0, 1, 1], np.int64))])
    outputs = [b.qdq(y, 0.02, 3)] + ([gate] if form == "read elsewhere" else [])
    shape = [2, 3, 32, 32] if form == "feature map" else [2, 3, 4, 4]
    inputs = [("x", shape)] + ([("z", shape)] if form == "two inputs" else [])
    model = b.model(inputs, outputs)
    rng = np.random.default_rng(0)
    feeds = {name: (rng.standard_normal(shape) * 4).astype(np.float32) for name, _ in inputs}
    expected = reference(model, feeds)
    if form == "nodes unsorted":  # as a Graph holds them after rewrites (a valid model file cannot)
        g = Graph(onnx.shape_inference.infer_shapes(model))
        g.graph.sort()
        nodes = list(g.graph)
        g.graph.remove(nodes)
        g.graph.extend(nodes[::-1])
        n = unary_to_table(g)
        converted = g.commit()
    else:
        findings = Findings()
        converted, (n,) = _apply(model, unary_to_table, findings=findings)
        assert (form == "feature map") == bool(findings.kept_float)
        assert all("3072 values a sample" in why for _, why in findings.kept_float.values())
    converts = form in ("hard-swish ops", "HardSwish", "hard-sigmoid, int8", "padded", "nodes unsorted")
    assert n == int(converts)
    if converts:
        assert "Gather" in ops(converted) and not {"Add", "Clip", "Div", "Mul", "HardSwish"} & set(ops(converted))
        for level in (ort.GraphOptimizationLevel.ORT_ENABLE_ALL, ort.GraphOptimizationLevel.ORT_DISABLE_ALL):
            np.testing.assert_array_equal(run(converted, feeds, level=level)[0], expected[0])
    else:
        assert ops(converted) == ops(model)


def test_attention_matmuls_with_a_quantized_output_become_qlinearmatmul_and_a_bias_first_is_a_bias():
    """P·V whose output a QuantizeLinear reads: QLinearMatMul (requantized in the kernel); Q·Kᵀ read by a float
    op: MatMulIntegerToFloat. A Linear written ``Add(bias, MatMul)`` converts as ``MatMul + bias``."""
    b = Builder()
    q, k = b.qdq("x", 0.05, 128), b.qdq("y", 0.04, 128)
    scores = b.node("Softmax", [b.node("MatMul", [q, k])], axis=-1)
    probs = b.qdq(scores, 1 / 255, 0)
    out = b.qdq(b.node("MatMul", [probs, b.qdq("v", 0.03, 128)]), 0.02, 128)
    w = b.weight((4, 6), axis=1)
    scale = 0.02 * onnx.numpy_helper.to_array(next(t for t in b.inits if t.name.startswith("ws")))
    bias = (np.round(np.linspace(-2, 2, 6) / scale) * scale).astype(np.float32)
    y = b.qdq(b.node("Add", [b.const(bias), b.node("MatMul", [out, w])]), 0.05, 128)
    model = b.model([("x", [2, 3, 4]), ("y", [2, 4, 3]), ("v", [2, 3, 4])], [y])
    converted, (n,) = _apply(model, gemm_to_qgemm)
    kinds = ops(converted)
    assert kinds.count("QLinearMatMul") == 1 and kinds.count("MatMulIntegerToFloat") == 1, kinds
    assert kinds.count("QGemm") == 1 and "Add" not in kinds, kinds
    feeds = {"x": _x([2, 3, 4])["x"], "y": _x([2, 4, 3], seed=2)["x"], "v": _x([2, 3, 4], seed=3)["x"]}
    np.testing.assert_allclose(run(converted, feeds)[0], reference(model, feeds)[0], atol=2 * 0.05 + 1e-6)


def test_a_shape_of_a_dequantized_tensor_reads_its_integers():
    """ShuffleNet's ``x.size()``: a DequantizeLinear read only by a Shape is not computed; the shape is the same."""
    from recal_onnx.passes.shapes_from_integers import shapes_from_integers

    b = Builder()
    x = b.qdq("x", 0.05, 128)
    shape = b.node("Shape", [x])
    model = b.model([("x", ["n", 4, 3, 3])], [shape])
    model.graph.output[0].type.tensor_type.elem_type = onnx.TensorProto.INT64
    converted, (n,) = _apply(model, shapes_from_integers)
    assert n == 1 and "DequantizeLinear" not in ops(converted), ops(converted)
    feeds = _x([2, 4, 3, 3])
    assert run(converted, feeds)[0].tolist() == reference(model, feeds)[0].tolist() == [2, 4, 3, 3]


def test_drop_exporter_metadata_keeps_other_keys():
    """The torch exporter's per-node record goes (its bytes counted); a user's own node metadata stays."""
    from recal_onnx.passes.drop_exporter_metadata import drop_exporter_metadata

    b = Builder()
    y = b.node("Relu", ["x"])
    model = b.model([("x", [2, 3])], [y])
    onnx.helper.set_metadata_props(model.graph.node[0], {"namespace": "m: M/relu: aten.relu",
                                                         "pkg.torch.onnx.stack_trace": 'File "/home/me/m.py"',
                                                         "owner": "team-a"})
    g = Graph(model)
    assert drop_exporter_metadata(g) == len("namespace") + len("m: M/relu: aten.relu") + len(
        "pkg.torch.onnx.stack_trace") + len('File "/home/me/m.py"')
    kept = g.commit().graph.node[0].metadata_props
    assert {p.key: p.value for p in kept} == {"owner": "team-a"}


def _masked_attention(value, also_read_by=None, tensor=False, whole_row=False):
    """scores + Where(mask, ``value``, 0) -> Softmax -> MatMul(., V), as Hugging Face's Swin masks its shifted
    windows (``tensor``: a constant of ``value``s and 0s, as timm's does; ``whole_row``: one row all masked); the
    probabilities are an output too. ``also_read_by``: an op that also reads the mask (not only the softmax)."""
    b = Builder()
    where = np.triu(np.ones((4, 4), bool), 1)  # each query sees itself and those before
    where[0] |= whole_row
    constant = np.where(where, np.float32(value), np.float32(0))
    mask = b.node("Unsqueeze", [b.const(constant) if tensor else b.node("Where", [
        b.const(where), b.const(np.float32(value)), b.const(np.float32(0))]), b.const(np.array([0]))])
    probs = b.node("Softmax", [b.node("Add", [b.node("Identity", ["s"]), mask])], axis=-1)
    out = b.node("MatMul", [probs, b.const(b.rng.standard_normal((4, 3)).astype(np.float32))])
    outputs = [out, probs] + ([b.node(also_read_by, [mask, mask])] if also_read_by else [])
    return b.model([("s", [2, 4, 4])], outputs)


@pytest.mark.parametrize("value, also_read_by, tensor, whole_row, rewritten", [
    (-100.0, None, False, False, True), (-64.0, None, False, False, True),  # HF Swin's mask; the least a mask may be
    (-100.0, None, True, False, True),  # timm Swin's: a constant
    (-100.0, "Mul", False, False, False), (-100.0, "Mul", True, False, False),  # the mask's values used elsewhere too
    (-100.0, None, True, True, False),  # a row masked whole: its probabilities are its scores' softmax
    (-5.0, None, False, False, False), (-1e5, None, False, False, False),  # not a mask; exact zeros already
], ids=["swin", "edge", "timm", "read-elsewhere", "read-elsewhere-timm", "whole-row", "not-a-mask", "exact-already"])
def test_masks_to_exact_zeros(value, also_read_by, tensor, whole_row, rewritten):
    """A softmax mask of -100 leaves float32 denormals (exp(-100) = 3.7e-44, slow on Intel CPUs); -10000 leaves
    exact zeros, and every other output bit for bit."""
    model = _masked_attention(value, also_read_by, tensor, whole_row)
    feeds = {"s": np.random.default_rng(1).uniform(-2, 2, (2, 4, 4)).astype(np.float32)}
    before = reference(model, feeds)
    findings = Findings()
    converted, (n,) = _apply(model, masks_to_exact_zeros, findings=findings)
    assert n == rewritten and bool(findings.masked_scores) == rewritten, findings.masked_scores
    after = run(converted, feeds)
    denormal = lambda p: int(((p != 0) & (np.abs(p) < np.finfo(np.float32).tiny)).sum())  # noqa: E731
    masked = np.triu(np.ones((4, 4), bool), 1)
    if rewritten:
        assert denormal(before[1]) > 0 if value == -100 else (before[1][:, masked] > 0).all()  # -64: e^-64, normal
        assert denormal(after[1]) == 0 and (after[1][:, masked] == 0).all()
        assert list(findings.masked_scores.values()) == [value]
        np.testing.assert_array_equal(after[0], before[0])
    else:
        np.testing.assert_array_equal(after[1], before[1])



def _folded_weight_graph(op, on_grid=True, quantized_input=True, channels_last=False):
    """A layer whose float weight is an int8 QAT weight with its quantization (and a BatchNorm scale) folded into
    floats, as tf2onnx writes tfmot's: ``q * step_c * bn_c`` in float32, per output channel, the input and output
    quantized; ``on_grid=False``: one value a third of a step off, or a weight on no grid at all ("random")."""
    b = Builder()
    shapes = {"Conv": ((6, 3, 3, 3), 0), "Gemm": ((6, 12), 0), "MatMul": ((12, 6), 1)}
    shape, axis = shapes[op]
    q = b.rng.integers(-127, 128, shape).astype(np.float32)
    q[(slice(None),) * axis + (1,)] = 0  # an all-zero channel
    q[(slice(None),) * axis + (2,)] = np.sign(q[(slice(None),) * axis + (2,)])  # a ternary one
    step = np.float32(0.01) * b.rng.uniform(0.5, 2, shape[axis]).astype(np.float32)
    bn = b.rng.uniform(0.5, 1.5, shape[axis]).astype(np.float32)
    along = [1] * len(shape)
    along[axis] = -1
    w = (q * step.reshape(along)) * bn.reshape(along)
    if on_grid == "random":
        w = b.rng.standard_normal(shape).astype(np.float32) * 0.3
    elif not on_grid:
        w.flat[7] += np.float32(0.33) * (step * bn).reshape(-1)[0 if axis == 0 else 7 % shape[1]]
    x_shape = {"Conv": [2, 3, 6, 6], "Gemm": [4, 12], "MatMul": [4, 12]}[op]
    if channels_last:
        x_shape = [2, 6, 6, 3]
    x = b.qdq("x", 0.03, 128) if quantized_input else "x"
    if channels_last:
        x = b.node("Transpose", [x], perm=[0, 3, 1, 2])
    attrs = {"Conv": {"pads": [1, 1, 1, 1]}, "Gemm": {"transB": 1}, "MatMul": {}}[op]
    inputs = [x, b.const(w, "w")] + ([b.const(b.rng.standard_normal(6).astype(np.float32) * 0.1, "bias")]
                                     if op != "MatMul" else [])
    y = b.qdq(b.node("Relu", [b.node(op, inputs, **attrs)]), 0.05, 0)
    return b.model([("x", x_shape)], [y]), w


@pytest.mark.parametrize("op, channels_last", [("Conv", False), ("Conv", True), ("Gemm", False), ("MatMul", False)])
def test_weights_from_grids_reads_a_folded_weight_as_the_int8_it_is(op, channels_last):
    """A float weight on an int8 grid per output channel (tf2onnx's fold of tfmot's weight quantizer and BatchNorm;
    a channel all zeros, one ternary) becomes DequantizeLinear of those integers along the output channels, the same
    values to float32 rounding; the conversion makes the layer integer and verifies it op by op."""
    model, w = _folded_weight_graph(op, channels_last=channels_last)
    findings = Findings()
    folded, (n,) = _apply(model, weights_from_grids, findings=findings)
    assert n == 1 and list(findings.grid_weights.values()) == [127]
    dq = next(node for node in folded.graph.node if node.op_type == "DequantizeLinear" and node.output[0] in
              {i for m in folded.graph.node if m.op_type == op for i in m.input[1:2]})
    values = {t.name: onnx.numpy_helper.to_array(t) for t in folded.graph.initializer}
    q, steps = values[dq.input[0]], values[dq.input[1]]
    axis = 1 if op == "MatMul" else 0
    assert q.dtype == np.int8 and steps.shape == (w.shape[axis],)
    assert onnx.helper.get_attribute_value(dq.attribute[0]) == axis
    along = [1] * w.ndim
    along[axis] = -1
    np.testing.assert_allclose(q * steps.reshape(along), w, rtol=3e-7, atol=1e-9)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        result = quantize_qat_export(model)
    assert ("QLinearConv" if op == "Conv" else "QGemm") in ops(result.model), ops(result.model)
    assert result.verification.local_steps <= 1 and len(result.grid_weights) == 1


@pytest.mark.parametrize("on_grid, quantized_input", [(False, True), ("random", True), (True, False)],
                         ids=["a-value-off-grid", "no-grid", "float-input"])
def test_weights_from_grids_zero_cases(on_grid, quantized_input):
    """A weight with one value a third of a step off its channel's grid, a float weight on no grid, and a weight on a
    grid whose layer reads a float input: none is rewritten."""
    model, _ = _folded_weight_graph("Conv", on_grid=on_grid, quantized_input=quantized_input)
    _, (n,) = _apply(model, weights_from_grids)
    assert n == 0


def test_grid_of_takes_each_channels_coarsest_grid():
    rows = np.array([[0.3, -0.1, 0.2, 0.0], [0.5, -0.5, 0.0, 0.5], [0.0, 0.0, 0.0, 0.0]], np.float32)
    q, steps = grid_of(rows)
    np.testing.assert_array_equal(q, [[3, -1, 2, 0], [1, -1, 0, 1], [0, 0, 0, 0]])
    np.testing.assert_allclose(steps, [0.1, 0.5, 0.5], rtol=1e-6)  # an all-zero channel takes another's step
    assert grid_of(np.array([[1.0, np.pi / 10]], np.float32)) is None
    assert grid_of(np.array([[np.nan, 0.1]], np.float32)) is None and grid_of(np.array([[np.inf, 0.1]])) is None


def test_a_float_layer_between_quantized_tensors_keeps_its_weights_in_a_default_session():
    """A float weight on no int8 grid, its input and output quantized (a mixed-precision export's float layer): a
    default onnxruntime session would quantize that weight to one int8 step itself (moving 11% of the next quantized
    tensor by up to 2 steps); the converted layer reads its input through a per-channel dequantization of its own,
    the same numbers, and the default session keeps the model as written, value for value. An integer layer in QDQ
    form is left as it is."""
    model, _ = _folded_weight_graph("Conv", on_grid="random")
    feeds = _x([2, 3, 6, 6])
    default = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    assert np.abs(run(model, feeds, level=default)[0] - reference(model, feeds)[0]).max() > 0.04  # moved
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = quantize_qat_export(model)
    assert result.verification.local_steps == 0, result.verification
    np.testing.assert_array_equal(run(result.model, feeds, level=default)[0], reference(model, feeds)[0])
    conv = next(name for name in result.float_reasons if name.startswith("Conv"))
    assert "on no int8 grid" in result.float_reasons[conv], result.float_reasons
    assert result.rewrites["shield_float_weights"] == 1
    integer, _ = _apply(_conv_graph(), bias_to_int32)
    assert _apply(integer, shield_float_weights)[1] == [0]


def test_a_weight_scaled_per_input_channel_is_written_as_its_float_values():
    """DQ(x), DQ(w, axis=1) -> Conv -> Q: left float by the converter, but onnxruntime's default session fuses it into
    a QLinearConv that fails at run time ("filter scale shape invalid"). With the weight written as the float32 values
    DequantizeLinear computes (its input then shielded as every float layer's is), the default session runs and
    gives what the file as written means; a per-output-channel weight is left as it is."""
    import onnxruntime as ort

    def graph(axis):
        b = Builder()
        x = b.qdq("x", 0.05, 128)
        y = b.qdq(b.node("Conv", [x, b.weight((4, 3, 3, 3), axis=axis)]), 0.1, 128)
        return b.model([("x", [1, 3, 6, 6])], [y])

    model, feeds = graph(axis=1), _x((1, 3, 6, 6))
    with pytest.raises(Exception, match="filter scale shape invalid"):
        run(model, feeds, level=ort.GraphOptimizationLevel.ORT_ENABLE_ALL)
    findings = Findings()
    result, counts = _apply(model, dequantize_misaligned_weights, shield_float_weights, findings=findings)
    assert counts == [1, 1] and "scales are along axis 1, not its output channels (axis 0)" in \
        findings.kept_float[next(iter(findings.kept_float))][1]
    np.testing.assert_array_equal(run(result, feeds, level=ort.GraphOptimizationLevel.ORT_ENABLE_ALL)[0],
                                  reference(model, feeds)[0])
    assert _apply(graph(axis=0), dequantize_misaligned_weights, findings=Findings())[1] == [0]


def test_qonnx_to_qcdq_computes_what_qonnx_defines():
    """QONNX's ``Quant`` as Brevitas's ``export_qonnx`` writes it and beyond: a signed 8-bit input, a per-channel
    narrow 8-bit weight (scale of shape [C, 1, 1, 1]), a 32-bit bias, a 4-bit unsigned activation (a Clip to 0..15),
    an unsigned narrow one with zero point 3 (a Clip to 0..254). Constants become their integers (int8 weight along
    axis 0, int32 bias), activations QuantizeLinear / Clip / DequantizeLinear; the model computes exactly what QONNX's
    definition (``qonnx_reference``) computes, and the QONNX domain goes."""
    b = Builder()
    rng = np.random.default_rng(0)
    w = rng.standard_normal((4, 3, 3, 3)).astype(np.float32) * 0.3
    w_scale = (np.abs(w).reshape(4, -1).max(1) / 127).astype(np.float32)
    x = qonnx_quant(b, "x", 0.05, 0, 8, signed=1)
    weight = qonnx_quant(b, b.const(w), w_scale.reshape(4, 1, 1, 1), 0, 8, signed=1, narrow=1)
    bias = qonnx_quant(b, b.const(rng.standard_normal(4).astype(np.float32) * 0.1), np.float32(0.05) * w_scale, 0,
                       32, signed=1)
    conv = b.node("Conv", [x, weight, bias], pads=[1, 1, 1, 1])
    low = qonnx_quant(b, b.node("Relu", [conv]), 0.04, 0, 4, signed=0)
    shifted = qonnx_quant(b, conv, 0.03, 3, 8, signed=0, narrow=1)
    model = qonnx_model(b, [("x", [2, 3, 6, 6])], [(b.node("Add", [low, shifted]), [2, 4, 6, 6])])
    findings = Findings()
    converted, (n,) = _apply(model, qonnx_to_qcdq, findings=findings)
    kinds = ops(converted)
    assert n == 5 and "Quant" not in kinds and kinds.count("Clip") == 2, kinds
    assert [o.domain for o in converted.opset_import] == [""]
    assert "5 Quant nodes" in findings.notes[0] and "1 of them add a zero point" in findings.notes[0]
    values = {t.name: onnx.numpy_helper.to_array(t) for t in converted.graph.initializer}
    dqs = [n for n in converted.graph.node if n.op_type == "DequantizeLinear" and n.input[0] in values]
    assert sorted(str(values[n.input[0]].dtype) for n in dqs) == ["int32", "int8"]
    assert all(a.i == 0 for n in dqs for a in n.attribute if a.name == "axis")
    feeds = _x([2, 3, 6, 6])
    np.testing.assert_array_equal(reference(converted, feeds)[0], qonnx_reference(model, feeds)[0])


# QONNX's table of its rounding modes, for 5.5, 2.5, 1.6, 1.1, 1.0 and their negatives
ROUNDED = {"ROUND": [6, 2, 2, 1, 1], "CEIL": [6, 3, 2, 2, 1], "FLOOR": [5, 2, 1, 1, 1], "UP": [6, 3, 2, 2, 1],
           "DOWN": [5, 2, 1, 1, 1], "HALF_UP": [6, 3, 2, 1, 1], "HALF_DOWN": [5, 2, 2, 1, 1]}
NEGATIVE = {"ROUND": [-6, -2, -2, -1, -1], "CEIL": [-5, -2, -1, -1, -1], "FLOOR": [-6, -3, -2, -2, -1],
            "UP": [-6, -3, -2, -2, -1], "DOWN": [-5, -2, -1, -1, -1], "HALF_UP": [-6, -3, -2, -1, -1],
            "HALF_DOWN": [-5, -2, -2, -1, -1]}


@pytest.mark.parametrize("mode", list(ROUNDED))
def test_qonnx_to_qcdq_rounds_a_constant_as_its_mode_says(mode):
    """A quantized constant keeps QONNX's rounding mode, whichever of its seven (QuantizeLinear has only half to
    even, which an activation needs): the integers are those of QONNX's own table."""
    b = Builder()
    table = np.array([5.5, 2.5, 1.6, 1.1, 1.0, -5.5, -2.5, -1.6, -1.1, -1.0], np.float32)
    q = qonnx_quant(b, b.const(table), 1.0, 0, 8, signed=1, rounding_mode=mode.lower())
    model = qonnx_model(b, [("x", [10])], [(b.node("Mul", ["x", q]), [10])])
    converted, (n,) = _apply(model, qonnx_to_qcdq, findings=Findings())
    feeds = {"x": np.ones(10, np.float32)}
    got = reference(converted, feeds)[0]
    np.testing.assert_array_equal(got, ROUNDED[mode] + NEGATIVE[mode])
    np.testing.assert_array_equal(got, qonnx_reference(model, feeds)[0])


def test_inputs_to_constants_holds_initializers_listed_as_inputs_as_constants_only():
    """torch.onnx's ``keep_initializers_as_inputs`` (Brevitas exports so): an initializer also listed as a graph
    input is a constant of the converted model, as the converter read it, and the note says so; the real input
    stays, and the model computes the same."""
    b = Builder()
    gamma = b.const(np.full(4, 1.5, np.float32), "gamma")
    model = b.model([("x", [2, 4])], [b.node("Mul", [b.qdq("x", 0.03, 128), gamma])])
    model.graph.input.append(onnx.helper.make_tensor_value_info(gamma, onnx.TensorProto.FLOAT, [4]))
    findings = Findings()
    converted, (n,) = _apply(model, inputs_to_constants, findings=findings)
    assert n == 1 and [i.name for i in converted.graph.input] == ["x"]
    assert "1 initializers the file also listed as graph inputs" in findings.notes[0]
    feeds = _x([2, 4])
    np.testing.assert_array_equal(run(converted, feeds)[0], reference(model, feeds)[0])


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


def test_encodings_to_qdq_quantizes_what_aimets_encodings_name():
    """AIMET's encodings on a float Gemm: its input at 4 bits (a QuantizeLinear, a Clip to 0..15, a DequantizeLinear;
    zero point ``-offset``), its weight per output channel (int8, zero point ``-offset - 128``), its bias at 32 bits
    (int32 multiples of its scale), its output (the graph output, keeping its name). The values are AIMET's:
    ``(clamp(round(x / s) - offset, 0, 2**bits - 1) + offset) * s``."""
    b = Builder()
    rng = np.random.default_rng(0)
    w, bias = b.const(rng.standard_normal((3, 4)).astype(np.float32), "w"), b.const(np.float32([0.1, -0.2, 0.3]), "b")
    y = b.node("Gemm", ["x", w, bias], transB=1)
    model = b.model([("x", [2, 4])], [y])
    entry = {"bw": 8, "dtype": "INT", "enc_type": "PER_TENSOR"}
    encodings = load_encodings({"version": "1.0.0", "activation_encodings": [
        {**entry, "name": "x", "bw": 4, "offset": [-3], "scale": [0.25]}, {**entry, "name": y, "offset": [-128],
                                                                           "scale": [0.05]}],
        "param_encodings": [{**entry, "name": w, "enc_type": "PER_CHANNEL", "offset": [-128] * 3,
                             "scale": [0.01, 0.02, 0.03]},
                            {**entry, "name": bias, "bw": 32, "offset": [-(2 ** 31)], "scale": [0.0025]}]})
    findings = Findings()
    converted, (n,) = _apply(model, lambda g, findings: encodings_to_qdq(g, findings, encodings), findings=findings)
    kinds = ops(converted)
    assert n == 4 and kinds.count("QuantizeLinear") == 2 and kinds.count("Clip") == 1, kinds
    assert [o.name for o in converted.graph.output] == [y]
    values = {t.name: onnx.numpy_helper.to_array(t) for t in converted.graph.initializer}
    assert sorted(str(values[n.input[0]].dtype) for n in converted.graph.node
                  if n.op_type == "DequantizeLinear" and n.input[0] in values) == ["int32", "int8"]
    x = np.linspace(-2, 5, 8, dtype=np.float32).reshape(2, 4)

    def aimet(v, s, offset, bits):  # the grid's integers exactly (float64 holds 32 bits); x / s in float32
        q = np.clip(np.round(np.float32(v) / np.float32(s)).astype(np.float64) - offset, 0, 2 ** bits - 1)
        return ((q + offset) * np.float32(s)).astype(np.float32)

    wq = aimet(onnx.numpy_helper.to_array(next(t for t in model.graph.initializer if t.name == w)),
               np.float32([[0.01], [0.02], [0.03]]), -128, 8)
    want = aimet(aimet(x, 0.25, -3, 4) @ wq.T + aimet(np.float32([0.1, -0.2, 0.3]), 0.0025, -(2 ** 31), 32),
                 0.05, -128, 8)
    np.testing.assert_allclose(reference(converted, {"x": x})[0], want, atol=1e-6)


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



def test_a_batchnorm_between_quantizers_is_exact_on_every_input_value():
    """Q -> DQ -> BatchNormalization -> Q (quantize_static without pre-processing): the integer depthwise conv gives
    what onnxruntime gives for the QDQ model as written on all 256 values of every channel, in a default session
    and with optimizations off (the weight of +-64 with its bias rounded differed near 1 value in 64)."""
    import onnxruntime as ort

    from recal_onnx import quantize_qat_export

    rng = np.random.default_rng(3)
    channels = 16
    b = Builder()
    params = [b.const(v.astype(np.float32)) for v in (rng.uniform(0.2, 3, channels), rng.normal(0, 1, channels),
                                                       rng.normal(0, 1, channels), rng.uniform(0.1, 2, channels))]
    y = b.node("BatchNormalization", [b.qdq("x", 0.037, 128), *params], epsilon=1e-5)
    model = b.model([("x", [1, channels, 256, 1])], [b.qdq(y, 0.041, 128)])
    result = quantize_qat_export(model, verify=False)
    assert "QLinearConv" in ops(result.model) and "BatchNormalization" not in ops(result.model)
    feed = {"x": np.broadcast_to(np.arange(256, dtype=np.float32).reshape(1, 1, 256, 1) * 0.037 - 128 * 0.037,
                                 (1, channels, 256, 1)).copy()}
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    want = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"]).run(None, feed)[0]
    for level in (ort.GraphOptimizationLevel.ORT_DISABLE_ALL, ort.GraphOptimizationLevel.ORT_ENABLE_ALL):
        options.graph_optimization_level = level
        got = ort.InferenceSession(result.model.SerializeToString(), options,
                                   providers=["CPUExecutionProvider"]).run(None, feed)[0]
        inexact = next((n for n in result.notes if "except" in n), "")
        assert np.array_equal(got, want) or inexact, (np.count_nonzero(got != want), result.notes)
    assert any("on all 256 input values of every channel" in n for n in result.notes)
