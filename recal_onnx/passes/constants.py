"""Constant handling: Constant nodes become initializers (and initializers listed as graph inputs too, constants
only), Identity nodes (and Casts to the type they read) go,
constant subgraphs fold.

Before::  Constant -> X,  W -> Identity -> Y,  W -> Mul(c) -> QuantizeLinear(s, zp) -> DQ -> Conv
After::   X (initializer), Y = W,              q_int8 (initializer) -> DQ -> Conv

``DequantizeLinear`` is never folded: a constant integer weight behind a DQ is the pattern the
quantized operators are made from. A QuantizeLinear of such a DQ (a constant requantized: ``quantize_static``
writes one where torch's exporter shares one zero bias between a LayerNorm and the layers after) folds to its
integers.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
from onnx import helper
from onnx.reference import ReferenceEvaluator

from ..findings import Findings
from ..graph import Graph, Node, Value
from ..qdq import dequantized

NEVER_FOLD = {"DequantizeLinear", "If", "Loop", "Scan", "RandomNormal", "RandomUniform", "RandomNormalLike",
              "RandomUniformLike", "Multinomial", "Bernoulli"}


def constants_to_initializers(g: Graph) -> int:
    count = 0
    for node in g.each("Constant"):
        if not node.domain and list(node.attributes) == ["value"]:
            _becomes_const(g, node.outputs[0], node.attributes["value"].value.numpy())
            g.remove(node)
            count += 1
    return count


def inputs_to_constants(g: Graph, findings: Findings) -> int:
    """Initializers the file also lists as graph inputs (torch.onnx's ``keep_initializers_as_inputs``, as Brevitas
    exports): the converter reads them as the constants they hold (weights fold into integers), so the converted
    model holds them as constants, not as inputs a caller could feed (onnxruntime warns of each at every load)."""
    listed = [value for value in g.graph.inputs if value.is_initializer()]
    for value in listed:
        g.graph.inputs.remove(value)
    if listed:
        findings.notes.append(f"{len(listed)} initializers the file also listed as graph inputs are constants of the "
                              "converted model, as the converter read them (their weights are now its integers)")
    return len(listed)


def _becomes_const(g: Graph, out: Value, value: np.ndarray) -> None:
    """A node output becomes an initializer of the same name (its producer is the caller's to remove)."""
    name, out.name = out.name, None
    g.replace(out, g.add_const(None, value, name=name))


def remove_dead_nodes(g: Graph) -> int:
    """Nodes whose outputs reach no graph output go first (onnxruntime drops them too): a value they read would
    otherwise look read outside the pattern it belongs to (an elementwise island, a layer and its Q)."""
    return g.remove_dead()


def remove_identities(g: Graph) -> int:
    """Identity nodes, Casts to the type they read (ModelOpt writes float-to-float ones on residual paths), and
    Concats of a single input (``torch.cat([x])``: DenseNet's first layer), go."""
    count = 0
    for node in g.each("Identity", "Concat", "Cast"):
        if node.op_type == "Concat" and len(node.inputs) != 1:
            continue
        if node.op_type == "Cast" and not _same_type_cast(node):
            continue
        if not node.outputs[0].is_graph_output():
            g.replace(node.outputs[0], node.inputs[0])
            g.remove(node)
            count += 1
    return count


def _same_type_cast(node: Node) -> bool:
    to, source = node.attributes.get("to"), node.inputs[0] if node.inputs else None
    return (to is not None and source is not None and source.type is not None
            and int(to.value) == int(source.type.dtype))


def fold_constants(g: Graph) -> int:
    """Evaluate every node (but DQ) whose inputs are all constants; repeat until none is left."""
    count = 0
    changed = True
    while changed:
        changed = False
        for node in g.each():
            if node.op_type in NEVER_FOLD or node.domain not in ("", "ai.onnx"):
                continue
            inputs = [i for i in node.inputs if i is not None]
            given = _requantized_constant(g, node)
            if not inputs or not all(g.is_const(i) or i.name in given for i in inputs) \
                    or any(o.is_graph_output() for o in node.outputs):
                continue
            values = _evaluate(node, g, g.opset, given)
            if values is None:
                continue
            for out, value in zip(node.outputs, values):
                _becomes_const(g, out, value)
            g.remove(node)
            g.drop_if_unused(*inputs)
            count += 1
            changed = True
    return count


def _requantized_constant(g: Graph, node: Node) -> dict[str, np.ndarray]:
    """For a QuantizeLinear of a DequantizeLinear of constants: its input's float value by name; else nothing."""
    source = g.producer(node.inputs[0]) if node.op_type == "QuantizeLinear" and node.inputs else None
    value = dequantized(g, source) if source is not None and source.op_type == "DequantizeLinear" else None
    return {} if value is None else {node.inputs[0].name: value}


def _evaluate(node: Node, g: Graph, opset: int, given: dict[str, np.ndarray] | None = None) -> list[np.ndarray] | None:
    inputs = {i.name: given[i.name] if given and i.name in given else g.const(i) for i in node.inputs if i is not None}
    proto = ir.serde.serialize_node(node)
    graph = helper.make_graph(
        [proto], "fold",
        [helper.make_tensor_value_info(name, helper.np_dtype_to_tensor_dtype(v.dtype), v.shape)
         for name, v in inputs.items()],
        [helper.make_tensor_value_info(o, onnx.TensorProto.UNDEFINED, None) for o in proto.output if o])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    try:
        outputs = ReferenceEvaluator(model).run(None, inputs)
    except Exception:  # noqa: BLE001 - an op the reference cannot run simply stays in the graph
        return None
    return [np.asarray(o) for o in outputs]
