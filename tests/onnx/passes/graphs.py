"""The tiny graphs and helpers the tests of . share."""

import numpy as np
import onnx

from recal_onnx.ir_edits import Graph
from recal_onnx.passes.thin_channels import thin_channels
from tests.support.onnx_graphs import Builder, reference, run


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


def _softmax_graph(out_scale):
    b = Builder()
    p = b.node("Softmax", [b.qdq("x", 0.05, 128)], axis=-1)
    return b.model([("x", [2, 4, 16, 16])], [b.qdq(p, out_scale, 0)])


def _steps_apart(model, converted, feeds, step):
    """How many output values of ``converted`` in a default session differ from ``model`` as written (in steps)."""
    diff = np.abs(run(converted, feeds, as_written=True)[0] - reference(model, feeds)[0]) / step
    return int(np.count_nonzero(diff > 0.5)), float(diff.max())


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


def _depthwise_as_tf2onnx_writes_it(new_shape=(3, 3, 1, 4)):
    """tf2onnx's Keras DepthwiseConv2D: the [h, w, channels, 1] kernel (per channel on axis 2), reshaped to
    ``new_shape`` and transposed to ONNX's [channels, 1, h, w], in a grouped Conv between QDQ activations."""
    b = Builder()
    kernel = b.node("Reshape", [b.weight((3, 3, 4, 1), axis=2), b.const(np.array(new_shape, np.int64))])
    conv = b.node("Conv", [b.qdq("x", 0.05, 128), b.node("Transpose", [kernel], perm=[3, 2, 0, 1])], group=4,
                  pads=[1, 1, 1, 1])
    return b.model([("x", [2, 4, 6, 6])], [b.qdq(conv, 0.05, 128)])


def _weight_only_graph(gemm: bool, group: int, n: int = 24, k: int = 64, bits: int = 4, dead_rows: int = 0):
    """``x -> MatMul(Transpose(Reshape(DQ(q [n*k/group, group], s, axis 0))))`` + bias: recal's weight-only export
    (``Gemm(transB=1)`` for a 2-D input); integers within +-1 (2 bits: ternary), +-7 (4 bits) or +-127; the first
    ``dead_rows`` output channels all zero (pruned)."""
    b = Builder()
    levels = {2: 1, 4: 7, 8: 127}[bits]
    q = b.rng.integers(-levels, levels + 1, (n * k // group, group)).astype(np.int8)
    q[:dead_rows * k // group] = 0
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


# QONNX's table of its rounding modes, for 5.5, 2.5, 1.6, 1.1, 1.0 and their negatives
ROUNDED = {"ROUND": [6, 2, 2, 1, 1], "CEIL": [6, 3, 2, 2, 1], "FLOOR": [5, 2, 1, 1, 1], "UP": [6, 3, 2, 2, 1],
           "DOWN": [5, 2, 1, 1, 1], "HALF_UP": [6, 3, 2, 1, 1], "HALF_DOWN": [5, 2, 2, 1, 1]}


NEGATIVE = {"ROUND": [-6, -2, -2, -1, -1], "CEIL": [-5, -2, -1, -1, -1], "FLOOR": [-6, -3, -2, -2, -1],
            "UP": [-6, -3, -2, -2, -1], "DOWN": [-5, -2, -1, -1, -1], "HALF_UP": [-6, -3, -2, -1, -1],
            "HALF_DOWN": [-5, -2, -2, -1, -1]}
