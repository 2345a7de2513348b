"""A float model and AIMET's encodings (``QuantizationSimModel.export``: the ONNX model without quantizers, and a
JSON file of scales and offsets by tensor name) as the QDQ model they mean together, so that it converts like any
QDQ file.

Before::  x -> Conv(W, b) -> BatchNormalization -> Relu -> y        {x: (s_x, o_x), W: (s_W, o_W), y: (s_y, o_y)}
After::   DQ(Q(x)) -> Conv(DQ(W_int8), b) -> BatchNormalization -> Relu -> DQ(Q(y))

AIMET means ``x = (q + offset) * scale``, ``q`` in ``[0, 2**bits - 1]``, rounded half to even. A parameter becomes its
integers, computed so (8 bits or fewer: int8 with zero point ``-offset - 128``; more, a bias: the int32 multiples of
its scale), per channel along the axis its reader takes (a Conv's or Gemm's output channels, a MatMul's columns).
An activation gets a QuantizeLinear / DequantizeLinear pair of zero point ``-offset`` (uint8, with a Clip below 8
bits; uint16 for 16 bits, in onnxruntime's domain before opset 21), before every reader and as the graph output it
may be. A tensor
AIMET simulates in float stays float32 (the note counts them). A name the model does not have, a per-channel
activation, a parameter whose channel axis its readers do not tell are refused by name.
It runs on the input, before the pipeline (``recal_onnx.pipeline.read_input``): verification then runs the model so
read as the QAT model, which AIMET's simulation computes (``scripts/interop_exports/aimet_export.py`` checks).
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from ..aimet_encodings import Encoding
from ..findings import Findings
from ..ir_edits import MS_DOMAIN, Graph, Value, attr
from ..errors import ModelError


def encodings_to_qdq(g: Graph, findings: Findings, encodings: list[Encoding] | None = None) -> int:
    if not encodings:
        return 0
    values = {v.name: v for v in [*g.graph.inputs, *g.graph.initializers.values()]}
    values.update({out.name: out for node in g.graph for out in node.outputs})
    counts = {"activations": 0, "parameters": 0, "float": 0}
    for e in encodings:
        value = values.get(e.name)
        if value is None:
            raise ModelError(f"the encodings name tensor {e.name!r}, which the model does not have (are they the "
                             "ones exported with this ONNX file?)")
        if e.floating:
            counts["float"] += 1
        elif e.param:
            _parameter(g, value, e)
            counts["parameters"] += 1
        else:
            if _activation(g, value, e):
                findings.notes.append(f"AIMET encodings: graph input {e.name!r} is also a graph output; the output "
                                      "stays the input as given (one name cannot be both it and its quantized value), "
                                      "its readers read it quantized")
            counts["activations"] += 1
    if counts["activations"] or counts["parameters"]:
        findings.notes.append(
            f"AIMET encodings: {counts['activations']} activations quantized and {counts['parameters']} parameters "
            "as their integers, as AIMET's simulation computes them, and verified against that"
            + (f"; {counts['float']} tensors it simulates in float stay float32" if counts["float"] else ""))
    return counts["activations"] + counts["parameters"]


def _parameter(g: Graph, value: Value, e: Encoding) -> None:
    weight = g.const(value)
    if weight is None:
        raise ModelError(f"the encodings quantize {e.name!r} as a parameter, but it is not a constant of the model")
    x = weight.astype(np.float32)
    axis = _channel_axis(g, value, e, x.shape)
    shape = [1] * x.ndim
    if axis is not None:
        shape[axis] = -1
    scale, offset = e.scales.reshape(shape), e.offsets.reshape(shape)
    q = np.clip(np.round(x / scale) - offset, 0, 2 ** e.bits - 1)  # AIMET's grid, unsigned
    per = (lambda a: a) if axis is not None else (lambda a: a.reshape(()))
    if e.bits <= 8:
        inputs = [g.add_const(value.name, (q - 128).astype(np.int8)),
                  g.add_const(f"{value.name}_scale", per(e.scales)),
                  g.add_const(f"{value.name}_zero_point", per((-e.offsets - 128).astype(np.int8)))]
    else:
        multiples = q + offset
        if np.abs(multiples).max(initial=0) > np.iinfo(np.int32).max:
            raise ModelError(f"parameter {e.name!r}: {e.bits}-bit integers beyond int32")
        inputs = [g.add_const(value.name, multiples.astype(np.int32)),
                  g.add_const(f"{value.name}_scale", per(e.scales))]
    dq = g.add_node("DequantizeLinear", inputs, name=f"{value.name}_dequantize",
                    **({} if axis is None else {"axis": axis}))
    for use in list(value.uses()):
        if use.node is not dq:
            use.node.replace_input_with(use.idx, dq.outputs[0])
    g.drop_if_unused(value)


def _channel_axis(g: Graph, value: Value, e: Encoding, shape: tuple) -> int | None:
    """None for one scale; else the axis of the channels the readers of ``value`` take (its size the scales')."""
    if e.scales.size == 1:
        return None
    axes = set()
    for use in value.uses():
        op, i = use.node.op_type, use.idx
        if i == 2 or len(shape) == 1:  # a bias
            axes.add(0)
        elif op == "Conv" and i == 1:
            axes.add(0)
        elif op == "ConvTranspose" and i == 1:
            axes.add(1)
        elif op == "Gemm" and i == 1:
            axes.add(0 if attr(use.node, "transB", 0) else 1)
        elif op == "MatMul" and i == 1:
            axes.add(len(shape) - 1)
        else:
            axes.add(None)
    if len(axes) != 1 or None in axes or shape[next(iter(axes))] != e.scales.size:
        raise ModelError(f"parameter {e.name!r} of shape {list(shape)} has {e.scales.size} per-channel encodings, "
                         "and its readers do not tell along which axis (a Conv, ConvTranspose, Gemm or MatMul weight "
                         "or a bias, with as many channels)")
    return next(iter(axes))


def _activation(g: Graph, value: Value, e: Encoding) -> bool:
    """Quantize ``value`` for its readers (and as the graph output it is); True where it is a graph input that is
    also an output, which keeps its name and its value there."""
    if e.scales.size != 1:
        raise ModelError(f"activation {e.name!r} has {e.scales.size} per-channel encodings; the integer kernels "
                         "take one scale an activation")
    if 8 < e.bits < 16 or e.bits > 16:
        raise ModelError(f"activation {e.name!r} is quantized to {e.bits} bits; the converter reads 2 to 8, and 16")
    dtype = np.uint8 if e.bits <= 8 else np.uint16
    domain = MS_DOMAIN if e.bits > 8 and g.opset < 21 else ""
    uses = list(value.uses())
    qparams = [g.add_const(f"{e.name}_scale", e.scales.reshape(())),
               g.add_const(f"{e.name}_zero_point", np.array(-e.offsets[0], dtype))]
    q = g.add_node("QuantizeLinear", [value, *qparams], name=f"{e.name}_quantize", domain=domain).outputs[0]
    if e.bits < 8:
        bounds = [g.add_const(f"{e.name}_{end}", np.array(v, dtype))
                  for end, v in zip(("lo", "hi"), (0, 2 ** e.bits - 1))]
        q = g.add_node("Clip", [q, *bounds], name=f"{e.name}_clip").outputs[0]
    out = g.add_node("DequantizeLinear", [q, *qparams], name=f"{e.name}_dequantize", domain=domain).outputs[0]
    for use in uses:
        use.node.replace_input_with(use.idx, out)
    if value.is_graph_output() and value in list(g.graph.inputs):  # never rename the user's input
        return True
    if value.is_graph_output():
        i = list(g.graph.outputs).index(value)
        name = value.name
        value.name = g.fresh(name)
        out.name, out.type, out.shape = name, value.type or ir.TensorType(ir.DataType.FLOAT), value.shape
        g.graph.outputs[i] = out
    return False
