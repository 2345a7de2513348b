"""Average pooling on quantized tensors: QLinearGlobalAveragePool / QLinearAveragePool (com.microsoft).

Before::  q -> DequantizeLinear(s, zp) -> GlobalAveragePool [-> Squeeze [-> Reshape]] -> QuantizeLinear(s2, zp2) -> q2
After::   q -> QLinearGlobalAveragePool(s, zp, s2, zp2) [-> Squeeze [-> Reshape]] -> q2

Shape-only ops (Squeeze, Flatten, Reshape, Unsqueeze; a chain, each read only by the next) may sit between the pool
and its QuantizeLinear, as tf2onnx writes Keras's and TensorFlow's global pooling (and squeeze-excitation's
Reshape back to 4-D after it): the pool then rounds once, to the QuantizeLinear's grid, and the shape ops run on the
integers.

A ReduceMean over the spatial axes of an NCHW tensor (keepdims=1), as the dynamo exporter writes
``adaptive_avg_pool2d(x, 1)``, is a global average pool; so is one over axes 1 and 2 of a channels-last tensor, as
Keras's ``GlobalAveragePooling2D`` computes on its PyTorch and JAX backends (the channels-last integer pool, then a
Squeeze of the pooled axes where the mean drops them):

Before::  q -> DequantizeLinear -> ReduceMean(axes=[1, 2], keepdims=0) -> QuantizeLinear -> q2
After::   q -> QLinearGlobalAveragePool(channels_last=1) -> Squeeze([1, 2]) -> q2

Where the input and output grids make a window's mean land exactly half a step between two integers for many sums
(the same scale on both, as ``quantize_static`` writes an AveragePool, and an even window: a quarter of all 2x2
sums), onnxruntime's integer pools round those ties otherwise than the QDQ model does in float (whose own float
noise decides them: nudged by 8 ulps, it rounds them otherwise itself), about one in eight a step apart: the pool's
output is named in ``findings.tied_pools`` with that share, and verification counts at most that share of its
values apart.
"""

from __future__ import annotations

import numpy as np

from ..findings import Findings
from ..ir_edits import MS_DOMAIN, SHAPE_READERS, Graph, Node, Value, attr, input_of
from ..errors import ModelError
from ..qdq import QTensor, activation, quantizes, scalar

AVERAGE_POOL_ATTRS = ("auto_pad", "ceil_mode", "count_include_pad", "kernel_shape", "pads", "strides")
SHAPE_ONLY = ("Squeeze", "Flatten", "Reshape", "Unsqueeze")
MAX_SHAPE_OPS = 4  # between a pool and its QuantizeLinear
TIES = 1e-3  # the share of a window's possible sums whose mean is an exact tie from which a pool is named


def average_pool_kind(g: Graph, node: Node) -> str | None:
    if node.op_type == "GlobalAveragePool":
        return "global"
    if node.op_type == "AveragePool" and not attr(node, "dilations"):
        return "average"
    if node.op_type == "ReduceMean" and g.rank(node.inputs[0]) == 4:
        axes = attr(node, "axes")
        if axes is None and input_of(node, 1) is not None:
            value = g.const(node.inputs[1])
            axes = None if value is None else value.reshape(-1).tolist()
        axes = None if axes is None else sorted(a % 4 for a in axes)
        if axes == [2, 3] and attr(node, "keepdims", 1) == 1:
            return "global"
        if axes == [1, 2]:
            return "global_channels_last"
    return None


def make_qlinear_pool(g: Graph, node: Node, x: QTensor, y_scale: Value, y_zero_point: Value,
                      replaces: Value | None = None) -> Node:
    inputs = [x.q, x.scale, x.zero_point, y_scale, y_zero_point]
    kind = average_pool_kind(g, node)
    if kind == "global":
        return g.add_node("QLinearGlobalAveragePool", inputs, name=node.name + "_quant", domain=MS_DOMAIN,
                          channels_last=0, replaces=replaces)
    if kind == "global_channels_last":
        keep = attr(node, "keepdims", 1) == 1
        pool = g.add_node("QLinearGlobalAveragePool", inputs, name=node.name + "_quant", domain=MS_DOMAIN,
                          channels_last=1, replaces=replaces if keep else None)
        if keep:
            return pool
        axes = g.add_const(node.name + "_pooled_axes", np.array([1, 2], np.int64))
        return g.add_node("Squeeze", [pool.outputs[0], axes], name=node.name + "_squeeze", replaces=replaces)
    attrs = {k: a for k, a in node.attributes.items() if k in AVERAGE_POOL_ATTRS}
    return g.add_node("QLinearAveragePool", inputs, name=node.name + "_quant", domain=MS_DOMAIN, replaces=replaces,
                      **attrs)


def quantize_after(g: Graph, value: Value) -> tuple[list[Node], Node] | None:
    """``(shape ops, QuantizeLinear)`` when ``value`` is quantized, directly (no shape ops) or through a chain of
    shape-only ops, each the only reader of the one before (besides ``Shape`` / ``Size`` nodes reading the pool's
    own output, as Hugging Face's ``pooled.reshape(pooled.shape[:2])`` writes: the integer pool has that shape)."""
    chain: list[Node] = []
    while len(chain) <= MAX_SHAPE_OPS:
        reader = g.only_consumer(value) if chain else _only_data_reader(g, value)
        if reader is None:
            return None
        if quantizes(g, reader, value):
            return chain, reader
        if reader.op_type not in SHAPE_ONLY or reader.inputs[0] is not value:
            return None
        chain.append(reader)
        value = reader.outputs[0]
    return None


def _only_data_reader(g: Graph, value: Value) -> Node | None:
    """The one node that reads ``value``'s values (Shape / Size readers aside), once."""
    if value.is_graph_output():
        return None
    readers = [n for n in g.consumers(value) if n.op_type not in SHAPE_READERS]
    if len(readers) != 1:
        return None
    return readers[0] if sum(u.node is readers[0] for u in value.uses()) == 1 else None


def pool_to_qlinear(g: Graph, findings: Findings | None = None) -> int:
    count = 0
    for node in g.each():
        if not node.inputs or average_pool_kind(g, node) is None:
            continue
        x = activation(g, node.inputs[0])
        after = quantize_after(g, node.outputs[0])
        if x is None or after is None:
            continue
        chain, q = after
        _check_global_range(g, node, x, q)
        ties = tie_share(g, node, x, q)
        if ties > TIES and findings is not None:
            findings.tied_pools[q.outputs[0].name] = ties
        shape_readers = [(u.node, u.idx) for u in node.outputs[0].uses() if u.node.op_type in SHAPE_READERS]
        if not chain:
            pooled = make_qlinear_pool(g, node, x, q.inputs[1], q.inputs[2], replaces=q.outputs[0]).outputs[0]
        else:
            out = pooled = make_qlinear_pool(g, node, x, q.inputs[1], q.inputs[2]).outputs[0]
            for i, shape in enumerate(chain):
                out = g.add_node(shape.op_type, [out, *shape.inputs[1:]], name=shape.name + "_int8",
                                 replaces=q.outputs[0] if i == len(chain) - 1 else None, **shape.attributes).outputs[0]
        for reader, index in shape_readers:  # the integer pool has the float one's shape
            reader.replace_input_with(index, pooled)
        g.remove(node, *chain, q)
        count += 1
    return count


def _check_global_range(g: Graph, node: Node, x: QTensor, q: Node) -> None:
    """onnxruntime's integer global pool computes ``s_in / (s_out * n)`` for a window of ``n`` values only within
    [2**-32, 256) (beyond, the output could not move off its zero point or would always saturate), and throws at run
    time otherwise, as it does on the QDQ file itself in a default session: such grids are a broken QAT model."""
    if node.op_type == "AveragePool":
        return
    ratio = float(scalar(g, x.scale)) / float(scalar(g, q.inputs[1]))
    n = _window(g, node)
    low, high = (ratio / n, ratio / n) if n else (ratio / 2**24, ratio)
    if not (low >= 2.0**-32 and high < 256.0):
        fate = "could not move off its zero point" if low < 2.0**-32 else "would always saturate"
        raise ModelError(f"{node.op_type} {node.name!r} averages on input scale {float(scalar(g, x.scale)):.3g} into "
                         f"output scale {float(scalar(g, q.inputs[1])):.3g}: over {n or 'its'} values its output "
                         f"{fate}, and onnxruntime's integer pool (as its own session of the QDQ file) refuses to run "
                         "it; the QAT model's quantizers are broken")


def tie_share(g: Graph, node: Node, x: QTensor, q: Node) -> float:
    """The share of a window's possible integer sums whose mean, requantized, is an exact tie (half a step); the
    largest over a few even windows where the window's size is not known."""
    s_in, s_out = scalar(g, x.scale), scalar(g, q.inputs[1])
    zp_in, zp_out = scalar(g, x.zero_point), scalar(g, q.inputs[2])
    info = np.iinfo(g.const(x.zero_point).dtype)
    share = 0.0
    for n in [n for n in (_window(g, node),) if n] or [2, 4, 8, 16, 64]:
        sums = np.unique(np.linspace(n * info.min, n * info.max, min(n * 255 + 1, 65_536)).round())
        mean = s_in * (sums - n * zp_in) / (n * np.float64(s_out)) + zp_out
        share = max(share, float(np.mean(np.abs(mean - np.floor(mean) - 0.5) < 1e-9)))
    return share


def _window(g: Graph, node: Node) -> int | None:
    """How many values one output of the pool averages, where the graph says (None where a size is dynamic)."""
    if node.op_type == "AveragePool":
        return int(np.prod(attr(node, "kernel_shape", [])) or 0) or None
    shape = node.inputs[0].shape
    if shape is None:
        return None
    if node.op_type == "GlobalAveragePool":
        dims = list(shape)[2:]
    else:  # a ReduceMean (average_pool_kind): its axes
        axes = attr(node, "axes") or (g.const(input_of(node, 1)).reshape(-1).tolist() if input_of(node, 1) else [])
        dims = [shape[a] for a in axes]
    return int(np.prod(dims)) if dims and all(isinstance(d, int) for d in dims) else None
