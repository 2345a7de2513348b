"""Constant subgraphs fold into initializers.

Before::  W -> Mul(c) -> QuantizeLinear(s, zp) -> DQ -> Conv
After::   q_int8 (initializer) -> DQ -> Conv

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

from ..ir_edits import Graph, Node
from ..qdq import dequantized
from .constants_to_initializers import becomes_const

NEVER_FOLD = {"DequantizeLinear", "If", "Loop", "Scan", "RandomNormal", "RandomUniform", "RandomNormalLike",
              "RandomUniformLike", "Multinomial", "Bernoulli"}


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
                becomes_const(g, out, value)
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
