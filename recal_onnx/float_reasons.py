"""Why a node stayed float: the rule of the converter it failed, with the value that failed it.

The converter's warning, ``ConversionResult.float_reasons`` and the CLI give every node left between a
DequantizeLinear and a QuantizeLinear one reason, so a user knows what to change in the QAT model (or that the
runtime has no integer kernel for it) instead of guessing. A pass that keeps a node float on purpose records its
own reason in ``Findings.kept_float``; this module explains the rest from the graph as the passes left it.
"""

from __future__ import annotations

import numpy as np

from .ir_edits import Graph, Node, input_of
from .passes import OPSET_12, on_a_grid
from .qdq import activation, output_axis, sixteen_bits, weight
from .quantized_ops import output_tail

WEIGHTED = {"Conv": 1, "Gemm": 1, "MatMul": 1, "ConvTranspose": 1}
NO_INTEGER_KERNEL = {"ConvTranspose", "LayerNormalization", "Erf", "Gelu", "Div", "Pow", "Sqrt", "Exp",
                     "Log", "Tanh", "ReduceMean", "ReduceSum", "InstanceNormalization", "GroupNormalization"}


def display_name(node: Node, position: int) -> str:
    """A node's name, or where its name is empty its op type and position in the graph (``Conv #12``)."""
    return node.name or f"{node.op_type} #{position}"


def float_reason(g: Graph, node: Node) -> str:
    """One clause: why ``node`` has no integer form here."""
    if node.op_type in WEIGHTED:
        return _weighted_reason(g, node)
    quantized_out = any(_quantized(g, c) for o in node.outputs for c in g.consumers(o))
    floats = [i for i in node.inputs if i is not None and not g.is_const(i) and activation(g, i) is None]
    if node.op_type in NO_INTEGER_KERNEL:
        return f"onnxruntime has no integer kernel for {node.op_type}"
    wide = _sixteen_bits(g, floats, node.outputs)
    if wide:
        return wide
    if floats:
        source = g.producer(floats[0])
        if source is not None and source.op_type == "DequantizeLinear" and g.is_const(source.inputs[0]):
            return (f"its input {floats[0].name!r} is a dequantized constant, which the converter reads as a layer's "
                    "weight or an operand of Add / Mul, not here")
        return (f"its input {floats[0].name!r} is float (made by {source.op_type if source else 'the graph input'}"
                ", not a DequantizeLinear of an integer tensor)")
    if not quantized_out:
        return "its output is float (no QuantizeLinear of scalar scale reads it alone)"
    if node.op_type == "BatchNormalization" and g.rank(node.inputs[0]) == 2:
        return ("it normalizes a [N, C] tensor (a BatchNorm1d after a Linear): as an integer depthwise conv on an "
                "added axis onnxruntime ran it slower than this float op (measured on LeViT)")
    if node.op_type in OPSET_12 and g.opset < 12:
        return (f"the model's opset is {g.opset}, and {node.op_type} takes 8-bit integers from opset 12; it runs on "
                "the dequantized values, exact")
    return f"no integer form of {node.op_type} with these inputs and attributes in this converter"


def _weighted_reason(g: Graph, node: Node) -> str:
    x, w_value = input_of(node, 0), input_of(node, WEIGHTED[node.op_type])
    if node.op_type == "ConvTranspose":
        return "onnxruntime has no integer kernel for ConvTranspose"
    source = g.producer(x)
    if g.is_const(w_value) and g.const(w_value).dtype.kind == "f":
        if not on_a_grid(node, g.const(w_value)):
            return ("its weight is float and on no int8 grid (a QAT weight whose quantization a tool folded into "
                    "floats lies on one, and is read back), so it computes in float as the file holds it")
        return (f"its weight is float, on an int8 grid, but its input {x.name!r} (made by "
                f"{source.op_type if source else 'the graph input'}) is not a dequantized activation the converter "
                "reads through")
    if activation(g, x) is None:
        wide = _sixteen_bits(g, [x])
        if wide:
            return wide
        if source is not None and source.op_type == "DequantizeLinear":
            scale = g.const(input_of(source, 1))
            if scale is not None and scale.size != 1:
                return f"its input is quantized per channel ({scale.size} scales; the integer ops take one)"
            return "its input's DequantizeLinear has a scale or zero point that is not a constant"
        return (f"its input {x.name!r} is float (made by {source.op_type if source else 'the graph input'}, "
                "not a DequantizeLinear of an integer tensor)")
    w = weight(g, w_value)
    if w is None:
        maker = g.producer(w_value)
        return (f"its weight is not a DequantizeLinear of a constant (made by "
                f"{maker.op_type if maker else 'a graph input' if not g.is_const(w_value) else 'a float constant'})")
    zps = np.unique(w.zero_point)
    if w.q.dtype != np.int8 or zps.size != 1:
        return (f"its weight is {w.q.dtype} with zero point {zps[0] if zps.size == 1 else f'{zps.min()}..{zps.max()}'}"
                f", and its values minus the zero point do not fit int8 (the integer kernels take int8 with one zero "
                "point for the whole weight)")
    if w.scale.size != 1 and w.scale.size != w.q.shape[w.axis]:
        return f"its weight has {w.scale.size} scales along axis {w.axis} of shape {list(w.q.shape)}"
    act, q = output_tail(g, node.outputs[0])
    wide = _sixteen_bits(g, outputs=node.outputs)
    if wide:
        return wide
    if q is None:
        if node.op_type in ("MatMul", "Gemm"):
            return "its output is float and its weight is not per output channel along the last axis"
        tail = act.outputs[0] if act is not None else node.outputs[0]
        readers = sorted({c.op_type for c in g.consumers(tail)} | ({"the graph output"} if tail.is_graph_output()
                                                                  else set()))
        return (f"its output{' after its ' + act.op_type if act is not None else ''} is read by "
                f"{', '.join(readers) or 'nothing'}, not by one QuantizeLinear alone, and onnxruntime's only integer "
                "conv with a float output (ConvInteger) runs about 10x slower than its float Conv (VNNI/AMX Xeon)")
    out_axis = output_axis(node, w.q.ndim)
    if w.scale.size > 1 and w.axis != out_axis:
        return (f"its weight's {w.scale.size} scales are along axis {w.axis}, not its output channels (axis "
                f"{out_axis})")
    bias = input_of(node, 2) if node.op_type in ("Conv", "Gemm") else None
    if bias is not None and not g.is_const(bias):
        maker = g.producer(bias)
        return (f"its bias {bias.name!r} is not a constant nor a DequantizeLinear of integers it alone reads as a "
                f"bias (made by {maker.op_type if maker else 'a graph input'})")
    return f"no integer form of {node.op_type} with these inputs and attributes in this converter"


def _sixteen_bits(g: Graph, inputs=(), outputs=()) -> str | None:
    """The clause for a 16-bit activation the node reads or writes (:func:`~recal_onnx.qdq.sixteen_bits`), else
    None."""
    found = sixteen_bits(g, inputs, outputs)
    if found is None:
        return None
    value, dtype, is_input = found
    subject = f"its input {value.name!r} is" if is_input else "its output is quantized to"
    return (f"{subject} 16 bits ({dtype}: mixed precision), and onnxruntime's integer kernels take 8-bit "
            "activations")


def _quantized(g: Graph, node: Node) -> bool:
    if node.op_type == "QuantizeLinear":
        return True
    if node.op_type in ("Relu", "Clip"):
        return any(c.op_type == "QuantizeLinear" for o in node.outputs for c in g.consumers(o))
    return False
