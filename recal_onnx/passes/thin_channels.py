"""Remove dead channels: filters that are exactly zero (weight rows and bias), or that no consumer reads
(the core's :func:`~recal_core.channel_coupling.live_channels`).

The channel spaces and which of them may drop channels are the core's rules
(:mod:`recal_core.channel_coupling`, shared with :func:`recal_torch.thin`); this pass describes the ONNX
graph in its terms and slices the initializers::

    Before:  x -> Conv(W[40], b[40]) -> Relu -> Q -> DQ -> Conv(V[., 40]) ...   (W rows 2, 5, ... (11) zero, b too)
    After:   x -> Conv(W[32], b[32]) -> Relu -> Q -> DQ -> Conv(V[., 32]) ...

A transformer's FFN is the same: ``MatMul(W[in, out]) -> Add(bias) -> GELU (Erf written out) or SiLU``,
(or any ``x * g(x)`` with ``g`` elementwise in ``x``: GELU's tanh form, GPT-2's) then the down-projection's
``MatMul``; its neurons are channels on the last axis. A gated MLP's
``SiLU(gate) * up`` (two tensors of one shape) joins the gate's and the up projection's channels, as an ``Add``
joins a residual's.

The channels kept are a multiple of 16 (dead ones are kept to make it up): onnxruntime's kernels run odd counts
much slower than the channels removed save.

Quantized weights (``DequantizeLinear`` of int8 constants, per-channel scales) are sliced with their
scales and zero points; the int8 values never change. Runs on the folded QDQ graph, before conversion.
"""

from __future__ import annotations

import logging

import numpy as np

from recal_core.channel_coupling import Op, channel_spaces, input_columns, live_channels

from ..findings import Findings
from ..ir_edits import Graph, Node, Value, attr, input_of, set_attr
from ..qdq import weight as weight_dq

log = logging.getLogger(__name__)

CHANNEL_BLOCK = 16  # thinned channel counts stay multiples of it
_SAME = {"Relu", "MaxPool", "AveragePool", "GlobalAveragePool", "GlobalMaxPool", "Identity", "Dropout",
         "LeakyRelu", "HardSwish", "Gelu"}


def thin_channels(g: Graph, block: int = CHANNEL_BLOCK, findings: Findings | None = None) -> int:
    """Remove the dead channels of each thinnable space, keeping a multiple of ``block``; return how many went
    (``findings.thinned``: which channels each thinned tensor kept)."""
    findings = Findings() if findings is None else findings
    removed = 0
    ops, nodes, values = _ops(g)
    matmul = {op.weight for op in ops if op.weight and nodes.get(op.name) is not None
              and nodes[op.name].op_type == "MatMul"}  # weights stored [in, out]

    def is_zero(name: str) -> np.ndarray:
        zero = _is_zero(g, values[name])
        return zero.T if name in matmul else zero

    for space in channel_spaces(ops):
        if not space.thinnable or not _one_channel_axis(g, space, nodes):
            continue
        keep = _whole_blocks(live_channels(space, is_zero), block)
        if keep.all():
            continue
        index = np.flatnonzero(keep)
        for op in space.producers:
            node = nodes[op.name]
            _slice_weight(g, node, 1, index, 1 if node.op_type == "MatMul" else 0)
            _slice_bias(g, node, index)
        for op, _ in space.followers:
            node = nodes[op.name]
            if node.op_type == "Add":  # a MatMul's bias
                slot = 0 if g.is_const(node.inputs[0]) else 1
                node.replace_input_with(slot, g.add_const(op.bias, np.take(g.const(node.inputs[slot]), index, axis=-1)))
                continue
            _slice_weight(g, node, 1, index, 0)
            _slice_bias(g, node, index)
            if "group" in node.attributes:
                set_attr(node, "group", len(index))
        for op, _ in space.consumers:
            node = nodes[op.name]
            axis = 0 if node.op_type == "MatMul" else 1
            _slice_weight(g, node, 1, input_columns(index, keep.size, _weight(g, node)[0].shape[axis]), axis)
        removed += int(keep.size - index.size)
        if not any(nodes[op.name].op_type == "MatMul" for op in space.producers):  # channels on axis 1
            findings.thinned.update({t: index for t in space.tensors})
        log.info("thinned %s: %d -> %d channels", ", ".join(p.name for p in space.producers), keep.size, index.size)
    return removed


def _one_channel_axis(g: Graph, space, nodes: dict[str, Node]) -> bool:
    """Whether every layer of ``space`` holds its channels on the same axis: convs and BatchNorm on axis 1, a
    MatMul on a tensor of rank 3 or more on its last axis (a MatMul reading a conv's NCHW output contracts its
    width, not its channels)."""
    ops = [p for p in space.producers] + [c for c, _ in space.consumers] + [f for f, _ in space.followers]
    types = {nodes[op.name].op_type for op in ops}
    last = any(nodes[op.name].op_type == "MatMul" and (g.rank(nodes[op.name].inputs[0]) or 3) > 2 for op in ops)
    return not (last and types & {"Conv", "BatchNormalization", "ConvTranspose"})


def _whole_blocks(keep: np.ndarray, block: int) -> np.ndarray:
    """``keep`` with dead channels added back (the first ones) up to a multiple of ``block``: onnxruntime's
    int8 kernels run a channel count off that multiple up to 3x slower (HF MobileNetV2, a depthwise conv of 14
    channels 1.52 ms, of 16 channels 0.54 ms on this machine), more than the channels removed save."""
    want = min(keep.size, -(-int(keep.sum()) // block) * block)
    dead = np.flatnonzero(~keep)
    keep = keep.copy()
    keep[dead[:want - int(keep.sum())]] = True
    return keep


def _ops(g: Graph) -> tuple[list[Op], dict[str, Node], dict[str, Value]]:
    """The graph as coupling ops (weight plumbing, ``DQ(const)``, is left out), the nodes by op name and the
    values by tensor name (the coupling rules name tensors)."""
    ops = [Op(i.name, "input", (), i.name) for i in g.graph.inputs if not i.is_initializer()]
    nodes: dict[str, Node] = {}
    values = {v.name: v for v in g.graph.initializers.values()}
    inside = _activations(g)  # GELU / SiLU written out: one zero-preserving op each
    for n, node in enumerate(g.nodes):
        name = node.name if node.name and node.name not in nodes else f"{node.op_type}_{n}"
        nodes[name] = node
        values.update({v.name: v for v in node.inputs if v is not None})
        data = tuple(i.name for i in node.inputs if i is not None and not g.is_const(i) and weight_dq(g, i) is None)
        out = node.outputs[0].name if node.outputs else None
        if node in inside:
            if inside[node] is not None:
                ops.append(Op(name, "same", (inside[node],), out))
            continue
        kind = _kind(g, node, data)
        if kind is None:
            continue  # a constant weight's DequantizeLinear
        if kind == "bias":
            const = next(i for i in node.inputs if g.is_const(i))
            ops.append(Op(name, "norm", data, out, None, const.name))
            continue
        if kind in ("layer", "depthwise"):
            bias = input_of(node, 2)
            ops.append(Op(name, kind, data[:1], out, node.inputs[1].name, bias.name if bias is not None else None))
        else:
            ops.append(Op(name, kind, data, out))
    ops.append(Op("the model's output", "output", tuple(o.name for o in g.graph.outputs)))
    return ops, nodes, values


def _kind(g: Graph, node: Node, data: tuple[str, ...]) -> str | None:
    t = node.op_type
    if t == "DequantizeLinear" and g.is_const(node.inputs[0]):
        return None
    if t in ("QuantizeLinear", "DequantizeLinear"):
        scale = g.const(input_of(node, 1))
        return "same" if scale is not None and scale.size == 1 and len(data) == 1 else "other"
    if t == "Conv" and len(data) == 1 and _weight(g, node) is not None:
        w = _weight(g, node)[0]
        group = attr(node, "group", 1)
        if group == 1:
            return "layer"
        if group == w.shape[0] and w.shape[1] == 1:
            return "depthwise"
        return "other"
    if t == "Gemm" and len(data) == 1 and _weight(g, node) is not None and attr(node, "transB", 0) == 1 \
            and not attr(node, "transA", 0) and attr(node, "alpha", 1.0) == 1.0 and attr(node, "beta", 1.0) == 1.0:
        return "layer"
    if t == "MatMul" and len(data) == 1 and data[0] == node.inputs[0].name and _weight(g, node) is not None \
            and _weight(g, node)[0].ndim == 2:
        return "layer"
    if t == "Add" and len(data) == 1 and _is_matmul_bias(g, node):
        return "bias"
    if t in _SAME and len(data) == 1:
        return "same"
    if t == "Clip" and len(data) == 1 and _clip_keeps_zero(g, node):
        return "same"
    if t == "ReduceMean" and len(data) == 1 and _spatial_axes(g, node):
        return "same"  # a global average pool written as a mean over the spatial axes
    if t == "Add" and len(data) == 2 and len(node.inputs) == 2:
        return "add"
    if t == "Mul" and len(data) == 2 and len(node.inputs) == 2 and node.inputs[0].shape is not None \
            and node.inputs[0].shape == node.inputs[1].shape:
        return "add"  # a gated MLP's act(gate) * up: one channel space, as a sum's
    if t == "Flatten" and attr(node, "axis", 1) == 1:
        return "flatten"
    return "other"


def _is_matmul_bias(g: Graph, node: Node) -> bool:
    """``Add(MatMul(x, W[in, out]), b[out])``: a Linear's bias, per channel on the last axis."""
    const = next((i for i in node.inputs if g.is_const(i)), None)
    data = next((i for i in node.inputs if not g.is_const(i)), None)
    layer = g.producer(data)
    if const is None or layer is None or layer.op_type != "MatMul" or _weight(g, layer) is None:
        return False
    bias = g.const(const)
    return bias.ndim == 1 and bias.shape[0] == _weight(g, layer)[0].shape[-1] > 1


def _scalar(g: Graph, value: Value | None, want: float | None = None) -> bool:
    v = g.const(value) if value is not None else None
    return v is not None and v.size == 1 and (want is None or abs(float(v.reshape(-1)[0]) - want) < 1e-6)


def _activations(g: Graph) -> dict[Node, str | None]:
    """GELU written out (``x * 0.5 * (1 + erf(x / sqrt 2))``, as the exporters write it) and SiLU
    (``x * sigmoid(x)``, the sigmoid quantized or not): their nodes, the last one mapped to the activation's
    input, the others to None."""
    found: dict[Node, str | None] = {}
    for erf in g.each("Erf"):
        div = g.producer(erf.inputs[0])
        if div is None or div.op_type not in ("Div", "Mul") or not any(_scalar(g, i) for i in div.inputs) or \
                (div.op_type == "Div" and not _scalar(g, div.inputs[1])):
            continue
        x = next((i for i in div.inputs if not g.is_const(i)), None)
        if x is None:
            continue
        add = g.only_consumer(erf.outputs[0])
        if add is None or add.op_type != "Add" or not any(_scalar(g, i, 1.0) for i in add.inputs):
            continue
        chain, node, by_x = [div, erf, add], add, False  # then x * . and * 0.5, in either order
        while (nxt := g.only_consumer(node.outputs[0])) is not None and nxt.op_type == "Mul" and (
                (x in nxt.inputs and not by_x) or any(_scalar(g, i) for i in nxt.inputs)):
            by_x = by_x or x in nxt.inputs
            chain.append(nxt)
            node = nxt
        if by_x:
            found.update({n: None for n in chain[:-1]})
            found[chain[-1]] = x.name
    for sigmoid in g.each("Sigmoid"):
        x, chain = sigmoid.inputs[0], [sigmoid]
        mul = g.only_consumer(sigmoid.outputs[0])
        while mul is not None and mul.op_type in ("QuantizeLinear", "DequantizeLinear") and \
                _scalar(g, input_of(mul, 1)):  # a QAT export's sigmoid, quantized on its way to the product
            chain.append(mul)
            mul = g.only_consumer(mul.outputs[0])
        if mul is not None and mul.op_type == "Mul" and x in mul.inputs:
            found.update({n: None for n in chain})
            found[mul] = x.name
    for mul in g.each("Mul"):  # any other x * g(x), g elementwise in x alone: GELU's tanh form (GPT-2's)
        if mul not in found and len(mul.inputs) == 2 and not any(g.is_const(i) for i in mul.inputs):
            found.update(_self_gate(g, mul))
    return found


_ELEMENTWISE = {"Add", "Sub", "Mul", "Div", "Pow", "Tanh", "Erf", "Sigmoid", "Exp", "Neg", "Sqrt", "Reciprocal"}


def _self_gate(g: Graph, mul: Node) -> dict[Node, str | None]:
    """``mul`` as ``a * g`` with ``a`` = ``x`` or ``x`` times a number and ``g`` computed from ``x`` and constants
    alone by elementwise ops read nowhere else: zero where ``x`` is, one op from ``x`` (empty if not so)."""
    for a, gate in (mul.inputs, mul.inputs[::-1]):
        scaled = g.producer(a)
        x = a
        if scaled is not None and scaled.op_type == "Mul" and g.only_consumer(a) is mul and \
                sum(g.is_const(i) and _scalar(g, i) for i in scaled.inputs) == 1:
            x = next(i for i in scaled.inputs if not g.is_const(i))
        inside, stack = set(), [g.producer(gate)]
        while stack:
            node = stack.pop()
            if node is None or node.op_type not in _ELEMENTWISE or len(inside) > 16:
                inside = None
                break
            if node in inside:
                continue
            inside.add(node)
            stack += [g.producer(i) for i in node.inputs if i is not None and not g.is_const(i) and i is not x]
        if inside and all(set(g.consumers(n.outputs[0])) <= inside | {mul} for n in inside) and \
                any(x in n.inputs for n in inside):
            parts = {n: None for n in inside} | ({scaled: None} if x is not a else {})
            return {**parts, mul: x.name}
    return {}


def _spatial_axes(g: Graph, node: Node) -> bool:
    axes = attr(node, "axes", None)
    if axes is None and input_of(node, 1) is not None:
        value = g.const(node.inputs[1])
        axes = None if value is None else [int(a) for a in np.asarray(value).reshape(-1)]
    rank = g.rank(node.inputs[0])
    return bool(axes) and rank is not None and all(2 <= (a + rank if a < 0 else a) < rank for a in axes)


def _clip_keeps_zero(g: Graph, node: Node) -> bool:
    bounds = [g.const(i) for i in node.inputs[1:3]]
    lo = float(bounds[0]) if bounds and bounds[0] is not None else -np.inf
    hi = float(bounds[1]) if len(bounds) > 1 and bounds[1] is not None else np.inf
    return all(i is None or g.is_const(i) for i in node.inputs[1:3]) and lo <= 0 <= hi


def _weight(g: Graph, node: Node) -> tuple[np.ndarray, object] | None:
    """The node's weight values (int8 if quantized, float otherwise) and its DQ view (or None)."""
    dq = weight_dq(g, node.inputs[1])
    if dq is not None:
        return dq.q, dq
    value = g.const(node.inputs[1])
    return (value, None) if value is not None else None


def _is_zero(g: Graph, value: Value) -> np.ndarray:
    """Elementwise, whether a weight or bias is zero: a quantized one where its integers equal the zero
    point, a float constant where it is 0 (a computed tensor: unknown, never zero)."""
    dq = weight_dq(g, value)
    if dq is None:
        value = g.const(value)
        return np.zeros(1, bool) if value is None else value == 0
    zp = np.asarray(dq.zero_point)
    if zp.size > 1:
        shape = [1] * dq.q.ndim
        shape[dq.axis] = -1
        zp = zp.reshape(shape)
    return dq.q == zp


def _slice_weight(g: Graph, node: Node, slot: int, index: np.ndarray, axis: int) -> None:
    value = node.inputs[slot]
    dq = weight_dq(g, value)
    if dq is None:
        node.replace_input_with(slot, g.add_const(value.name, np.take(g.const(value), index, axis=axis)))
        return
    dq.dq.replace_input_with(0, g.add_const(dq.dq.inputs[0].name, np.take(dq.q, index, axis=axis)))
    if axis == dq.axis:  # per-channel scale and zero point along the sliced axis
        for i in (1, 2):
            param = input_of(dq.dq, i)
            if param is not None and g.const(param).size > 1:
                dq.dq.replace_input_with(i, g.add_const(param.name, np.take(g.const(param), index, axis=0)))


def _slice_bias(g: Graph, node: Node, index: np.ndarray) -> None:
    bias = input_of(node, 2)
    if bias is not None:
        if g.is_const(bias):
            node.replace_input_with(2, g.add_const(bias.name, np.take(g.const(bias), index, axis=0)))
        elif weight_dq(g, bias) is not None:
            _slice_weight(g, node, 2, index, 0)
