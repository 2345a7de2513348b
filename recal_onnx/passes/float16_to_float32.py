"""A QDQ model computing in float16 computes in float32: onnxruntime's integer kernels take float32 scales and
write float32 (they have no float16 form), so a float16 scale left a QLinearConv invalid and a MatMulIntegerToFloat
bound to two float types. NVIDIA ModelOpt's ONNX quantizer writes such models at its default
(``high_precision_dtype="fp16"``: every float constant and scale in float16, Casts at the float32 inputs and outputs).

Before::  x (float32) -> Cast(to=float16) -> QuantizeLinear(s: float16) -> ... -> Cast(to=float32) -> y
After::   x (float32) -> Cast(to=float32) -> QuantizeLinear(s: float32) -> ... -> Cast(to=float32) -> y

Every float16 constant becomes the float32 of the same value (exact), every Cast to float16 a Cast to float32 (a
no-op that ``remove_identities`` then drops); a float16 graph input or output keeps its type through a Cast of its
own. The integers are the same; the float ops between them (LayerNorm, GELU, softmax) compute in float32, as
onnxruntime already runs most float16 ops on an x86 CPU. ``findings.notes`` says so. The verification's reference is
the input so upcast (:func:`float32_reference`): the same model in float32, since its float16 rounding alone moves
integers on a rounding boundary (0.2% of a ModelOpt ResNet's) and is no part of what the QDQ file means.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir

from ..findings import Findings
from ..ir_edits import Graph, attr, set_attr
from .constants_to_initializers import constants_to_initializers

FLOAT16 = ir.DataType.FLOAT16


def float16_to_float32(g: Graph, findings: Findings) -> int:
    count = 0
    outputs = [i for i, value in enumerate(g.graph.outputs) if _float16(value)]
    for value in list(g.graph.initializers.values()):
        if _float16(value) and value not in g.graph.inputs:
            g.replace(value, g.add_const(value.name, g.const(value).astype(np.float32)))
            g.drop_if_unused(value)
            count += 1
    for node in g.each():
        if node.op_type == "Cast" and attr(node, "to") == onnx.TensorProto.FLOAT16:
            set_attr(node, "to", onnx.TensorProto.FLOAT)
            count += 1
        elif node.op_type == "ConstantOfShape" and node.attributes.get("value") is not None:
            fill = node.attributes["value"].value
            if fill.dtype == FLOAT16:
                set_attr(node, "value", onnx.numpy_helper.from_array(fill.numpy().astype(np.float32)))
                count += 1
        for out in node.outputs:
            if _float16(out):
                out.type = ir.TensorType(ir.DataType.FLOAT)
    for value in list(g.graph.inputs):
        if _float16(value):
            cast = g.add_node("Cast", [value], name=f"{value.name}_to_float32", to=onnx.TensorProto.FLOAT)
            for use in list(value.uses()):
                if use.node is not cast:
                    use.node.replace_input_with(use.idx, cast.outputs[0])
            count += 1
    for i in outputs:
        value = g.graph.outputs[i]
        if value.producer() is not None:
            cast = g.add_node("Cast", [value], name=f"{value.name}_to_float16", to=onnx.TensorProto.FLOAT16)
            name = value.name
            value.name = g.fresh(name)
            cast.outputs[0].name, cast.outputs[0].type = name, ir.TensorType(FLOAT16)
            cast.outputs[0].shape = value.shape
            g.graph.outputs[i] = cast.outputs[0]
            count += 1
    if count:
        findings.notes.append("the model computed in float16: its float constants and scales are now float32 (the "
                              "same values) and its float ops compute in float32, as onnxruntime's integer kernels "
                              "and its x86 CPU kernels take them, verified against it computing so (float16 rounding "
                              "moves integers on rounding boundaries by a step); inputs and outputs keep their types")
    return count


def float32_reference(model: onnx.ModelProto) -> onnx.ModelProto | None:
    """``model`` computing in float32 where it computes in float16 (the verification's reference), else None."""
    half = onnx.TensorProto.FLOAT16
    holds = (any(t.data_type == half for t in model.graph.initializer)
             or any(v.type.tensor_type.elem_type == half for v in model.graph.input)
             or any((a.name == "to" and a.i == half) or a.t.data_type == half
                    for n in model.graph.node for a in n.attribute))
    if not holds:  # (checked on the proto first: no copy of a model that holds no float16)
        return None
    g = Graph(model)
    constants_to_initializers(g)  # float16 Constant nodes too
    float16_to_float32(g, Findings())
    return g.commit()


def _float16(value: ir.Value) -> bool:
    return value.type is not None and isinstance(value.type, ir.TensorType) and value.type.dtype == FLOAT16
