"""A function of one quantized tensor, computed in float between its DequantizeLinear and a QuantizeLinear, whose
every output value depends on the one input value at its place: a 256-entry table of integers, looked up with Gather.

Before::  q -> DequantizeLinear(s, zp) -> elementwise ops and scalar constants (hard-swish: Add 3, Clip 0..6,
          Div 6, Mul by the input) -> QuantizeLinear(s2, zp2) -> q2
After::   q -> Cast(int32) -> Gather(table) -> q2

A zero padding between the ops and the QuantizeLinear (a ZeroPadding2D before a strided conv) moves after the
table, padding with ``zp2`` (the integer of 0).

onnxruntime has no integer kernel for hard-swish or hard-sigmoid (MobileNetV3's activations), nor for most other
activations; ``QLinearSigmoid`` is this same table for the sigmoid alone (:mod:`.sigmoid_to_qlinear`, which runs
first). The table holds the QAT model's own ops run by onnxruntime on each of the 256 integers, as written (the
verification's reference), so the int8 model computes what the QAT model computes, value for value. An int8 input
indexes the table's end for its negative values (Gather counts negative indices from the end).

onnxruntime's Gather looks a byte up slower than its vectorized float ops compute them: measured on one hard-swish,
one thread, the table costs 0.72x the float ops on 96 values a sample (a squeeze-excitation gate), 1.5x on 4,096 and
3-5x on feature maps of 16,384 to 301,056. So only a tensor of at most :data:`TABLE_MAX` values a sample becomes a
table; a larger one stays float (exact as well: the QAT model's own ops), named with that reason.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir

from ..findings import Findings
from ..ir_edits import Graph, Node, Value
from ..qdq import activation

TABLE_MAX = 1024  # values a sample, at most, for a table (above it the float ops are faster)

# ops whose every output value is a function of the values at the same place of their inputs (ONNX domain)
ELEMENTWISE = {"Abs", "Add", "Ceil", "Clip", "Div", "Elu", "Erf", "Exp", "Floor", "Gelu", "HardSigmoid", "HardSwish",
               "Identity", "LeakyRelu", "Log", "Max", "Min", "Mul", "Neg", "Pow", "Reciprocal", "Relu", "Round",
               "Selu", "Sigmoid", "Sign", "Softplus", "Softsign", "Sqrt", "Sub", "Tanh"}


def unary_to_table(g: Graph, findings: Findings | None = None) -> int:
    count = 0
    for q in g.each("QuantizeLinear"):
        found = _island(g, q)
        if found is None:
            continue
        source, nodes, pad = found
        size = _per_sample(source.dq.outputs[0])
        if size is None or size > TABLE_MAX:
            if findings is not None:
                why = (f"onnxruntime computes these float ops faster than it looks up a table of integers on "
                       f"{size if size is not None else 'an unknown number of'} values a sample (a table from "
                       f"{TABLE_MAX} down); exact all the same")
                for node in nodes:
                    findings.kept_float.setdefault(node.name, (node.op_type, why))
            continue
        table = _table(g, source, nodes, q)
        if table is None:
            continue
        name = q.name or "table"
        indices = g.add_node("Cast", [source.q], name=name + "_index", to=onnx.TensorProto.INT32).outputs[0]
        gather = g.add_node("Gather", [g.add_const(name + "_table", table), indices], name=name + "_table", axis=0,
                            replaces=None if pad else q.outputs[0])
        if pad is not None:  # Q(pad(y, 0)) = pad(Q(y), zp2)
            zero = g.add_const(name + "_pad_value", np.asarray(g.const(q.inputs[2])).reshape(()))
            g.add_node("Pad", [gather.outputs[0], pad.inputs[1], zero, *pad.inputs[3:]], name=pad.name or "pad",
                       mode="constant", replaces=q.outputs[0])
        g.remove(q, *([pad] if pad is not None else []), *reversed(nodes))
        count += 1
    return count


def _per_sample(value: Value) -> int | None:
    """The number of values a sample of ``value`` holds (its dims after the first), None when a dim is unknown."""
    if value.shape is None or len(value.shape) == 0:
        return None
    dims = list(value.shape)[1:]
    return int(np.prod(dims)) if all(isinstance(d, int) for d in dims) else None


def _zero_pad(g: Graph, node: Node | None) -> bool:
    """Whether ``node`` is a constant-mode Pad by constant pads with 0 (or no value), read only by the Q."""
    if node is None or node.op_type != "Pad" or node.domain not in ("", "ai.onnx"):
        return False
    mode = node.attributes.get("mode")
    value = node.inputs[2] if len(node.inputs) > 2 else None
    return ((mode is None or mode.as_string() == "constant") and len(node.inputs) > 1 and g.is_const(node.inputs[1])
            and (value is None or (g.is_const(value) and not np.any(g.const(value))))
            and not node.outputs[0].is_graph_output() and len(g.consumers(node.outputs[0])) == 1)


def _island(g: Graph, q: Node):
    """``(the dequantized activation, the island's nodes in the order they compute, a zero Pad before the Q or
    None)`` for a QuantizeLinear fed by elementwise ops of one dequantized activation and scalar constants, each
    read only inside the island; else None."""
    if g.is_const(q.inputs[0]) or len(q.inputs) < 3 or \
            any(g.const(v) is None or g.const(v).size != 1 for v in q.inputs[1:3]):
        return None
    pad = g.producer(q.inputs[0])
    pad = pad if _zero_pad(g, pad) else None
    end = pad.inputs[0] if pad is not None else q.inputs[0]
    source, nodes, todo, seen = None, [], [end], set()
    while todo:
        value = todo.pop()
        if value is None or id(value) in seen:
            continue
        seen.add(id(value))
        if g.is_const(value):
            if g.const(value).size != 1:
                return None  # per channel: a table per channel, not one
            continue
        found = activation(g, value)
        if found is not None:
            if source is not None and source.dq is not found.dq:
                return None  # two quantized inputs: a binary op (binary_to_qlinear's)
            source = found
            continue
        node = g.producer(value)
        if node is None or node.domain not in ("", "ai.onnx") or node.op_type not in ELEMENTWISE \
                or len(node.outputs) != 1:
            return None
        nodes.append(node)
        todo.extend(node.inputs)
    if source is None or not nodes or (len(nodes) == 1 and nodes[0].op_type == "Sigmoid"):
        return None  # nothing computed, or QLinearSigmoid's
    island = set(map(id, nodes)) | {id(q)} | ({id(pad)} if pad is not None else set())
    for node in nodes:  # read nowhere else: the island goes
        value = node.outputs[0]
        if value.is_graph_output() or any(id(user) not in island for user in g.consumers(value)):
            return None
    rank = g.rank(source.dq.outputs[0])
    if any(g.is_const(v) and g.const(v).ndim > (rank if rank is not None else 0) for n in nodes for v in n.inputs):
        return None  # a constant of higher rank would change the output's shape
    return source, _in_order(nodes, source.dq), pad


def _in_order(nodes: list[Node], dq: Node) -> list[Node]:
    """``nodes`` each after the nodes it reads (a graph rewritten by earlier passes is not in that order): Kahn's
    topological sort, linear in the island's size (a hostile 10,000-node chain took minutes when each step searched
    the nodes left)."""
    producer = {id(n.outputs[0]): n for n in nodes}
    waiting = {id(n): sum(v is not None and id(v) in producer for v in n.inputs) for n in nodes}
    readers: dict[int, list[Node]] = {}
    for node in nodes:
        for v in node.inputs:
            if v is not None and id(v) in producer:
                readers.setdefault(id(v), []).append(node)
    ready = [n for n in nodes if waiting[id(n)] == 0]
    ordered = []
    while ready:
        node = ready.pop()
        ordered.append(node)
        for reader in readers.get(id(node.outputs[0]), []):
            waiting[id(reader)] -= 1
            if waiting[id(reader)] == 0:
                ready.append(reader)
    return ordered


def _table(g: Graph, source, nodes: list[Node], q: Node) -> np.ndarray | None:
    """The island run by onnxruntime (optimizations off) on each integer of the source's type, in Gather's order."""
    import onnxruntime as ort

    dtype = g.const(source.zero_point).dtype
    if dtype not in (np.uint8, np.int8):
        return None
    values = np.arange(256).astype(dtype) if dtype == np.uint8 else np.arange(256).astype(np.uint8).view(np.int8)
    graph = ir.Graph([ir.Value(name="q", type=ir.TensorType(ir.DataType.from_numpy(dtype)), shape=ir.Shape([256]))],
                     [], nodes=[], opset_imports={"": g.opset})
    copied: dict[int, ir.Value] = {}

    def input_(value: Value | None) -> ir.Value | None:
        if value is None:
            return None
        if id(value) not in copied:
            array = g.const(value)
            copied[id(value)] = ir.Value(name=value.name, const_value=ir.tensor(array))
            graph.register_initializer(copied[id(value)])
        return copied[id(value)]

    dq = ir.node("DequantizeLinear", [graph.inputs[0], input_(source.scale), input_(source.zero_point)])
    graph.append(dq)
    copied[id(source.dq.outputs[0])] = dq.outputs[0]
    for node in nodes:
        new = ir.node(node.op_type, [input_(v) for v in node.inputs], {a.name: a for a in node.attributes.values()})
        graph.append(new)
        copied[id(node.outputs[0])] = new.outputs[0]
    end = ir.node("QuantizeLinear", [copied[id(nodes[-1].outputs[0])], input_(q.inputs[1]), input_(q.inputs[2])],
                  {a.name: a for a in q.attributes.values()})
    graph.append(end)
    graph.outputs.append(end.outputs[0])
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    proto = ir.serde.serialize_model(ir.Model(graph, ir_version=8))
    try:
        session = ort.InferenceSession(proto.SerializeToString(), options, providers=["CPUExecutionProvider"])
        table = np.asarray(session.run(None, {"q": values})[0]).reshape(-1)
    except Exception:  # noqa: BLE001 - an island onnxruntime cannot run alone stays as it is (named float)
        return None
    return table if table.size == 256 else None
