"""Constant handling: Constant nodes become initializers, Identity nodes go, constant subgraphs fold.

Before::  Constant -> X,  W -> Identity -> Y,  W -> Mul(c) -> QuantizeLinear(s, zp) -> DQ -> Conv
After::   X (initializer), Y = W,              q_int8 (initializer) -> DQ -> Conv

``DequantizeLinear`` is never folded: a constant integer weight behind a DQ is the pattern the
quantized operators are made from.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper
from onnx.reference import ReferenceEvaluator

from ..graph import Graph

NEVER_FOLD = {"DequantizeLinear", "If", "Loop", "Scan", "RandomNormal", "RandomUniform", "RandomNormalLike",
              "RandomUniformLike", "Multinomial", "Bernoulli"}


def constants_to_initializers(g: Graph) -> int:
    count = 0
    for node in list(g.nodes):
        if node.op_type == "Constant" and not node.domain and len(node.attribute) == 1 \
                and node.attribute[0].name == "value":
            g.set_const(node.output[0], numpy_helper.to_array(node.attribute[0].t))
            g.nodes.remove(node)
            count += 1
    g.refresh()
    return count


def remove_identities(g: Graph) -> int:
    count = 0
    for node in list(g.nodes):
        if node.op_type == "Identity" and node.output[0] not in g.outputs:
            g.nodes.remove(node)
            g.refresh()
            g.replace_uses(node.output[0], node.input[0])
            count += 1
    return count


def fold_constants(g: Graph) -> int:
    """Evaluate every node (but DQ) whose inputs are all constants; repeat until none is left."""
    opsets = {o.domain: o.version for o in g.model.opset_import}
    count = 0
    changed = True
    while changed:
        changed = False
        for node in list(g.nodes):
            if node.op_type in NEVER_FOLD or node.domain not in ("", "ai.onnx"):
                continue
            inputs = [i for i in node.input if i]
            if not inputs or not all(g.is_const(i) for i in inputs) or any(o in g.outputs for o in node.output):
                continue
            values = _evaluate(node, g, opsets.get("", 17))
            if values is None:
                continue
            for name, value in zip(node.output, values):
                g.set_const(name, value)
            g.nodes.remove(node)
            g.refresh()
            g.drop_if_unused(*node.input)
            count += 1
            changed = True
    return count


def _evaluate(node: onnx.NodeProto, g: Graph, opset: int) -> list[np.ndarray] | None:
    inputs = [i for i in node.input if i]
    graph = helper.make_graph(
        [node], "fold",
        [helper.make_tensor_value_info(i, helper.np_dtype_to_tensor_dtype(g.const(i).dtype), g.const(i).shape)
         for i in dict.fromkeys(inputs)],
        [helper.make_tensor_value_info(o, onnx.TensorProto.UNDEFINED, None) for o in node.output if o])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    try:
        outputs = ReferenceEvaluator(model).run(None, {i: g.const(i) for i in dict.fromkeys(inputs)})
    except Exception:  # noqa: BLE001 - an op the reference cannot run simply stays in the graph
        return None
    return [np.asarray(o) for o in outputs]
