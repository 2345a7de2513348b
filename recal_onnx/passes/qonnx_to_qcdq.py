"""QONNX's integer quantizer (``Quant``, now ``IntQuant``: Brevitas's ``export_qonnx``, FINN, hls4ml) as the
QuantizeLinear / Clip / DequantizeLinear (QCDQ) it means, so that its model converts like any QDQ file.

QONNX defines ``Quant(x, scale, zeropt, bitwidth)`` as ``(rnd(clip(x / scale + zeropt, lo, hi)) - zeropt) * scale``,
``lo, hi`` from ``bitwidth``, ``signed`` and ``narrow``. onnxruntime cannot run it (a custom domain).

Before::  W (float) -> Quant(s_w, 0, 8, narrow) -> Conv <- Quant(x, s_x, 0, 8) ;  b -> Quant(s_x * s_w, 0, 32) -> Conv
After::   DQ(W_int8, s_w) -> Conv <- DQ(Clip?(Q(x, s_x))) ;  DQ(b_int32, s_x * s_w) -> Conv

A constant's quantization is computed here as QONNX computes it (float32, its rounding mode, any of QONNX's seven):
weights become int8 / uint8, biases of up to 32 bits int32, the same numbers bit for bit. An activation's becomes
QuantizeLinear (which rounds half to even, QONNX's ``ROUND``) with a Clip where the range is narrower than 8 bits.
A zero point of 0 (what Brevitas writes) makes that exact; another is added after rounding rather than before, which
moves a value within a float32 ulp of a rounding tie by a step (``findings.notes`` says so). What has no such form
is refused by node, with the reason: a scale or zero point computed at run time, an activation of more than 8 bits
or rounded other than half to even, a zero point that is no integer, a scale over several axes.
It runs on the input, before the pipeline (``recal_onnx.pipeline.read_input``): the converter starts from the model
so read, which is also verification's reference, since onnxruntime runs it and not the QONNX.
"""

from __future__ import annotations

import numpy as np

from ..findings import Findings
from ..ir_edits import Graph, Node, attr
from ..errors import ModelError
from ..input_checks import QONNX_QUANTIZERS, is_qonnx_domain, is_qonnx_quantizer

ROUNDING = {  # QONNX's rounding modes (upper case; ROUND_TO_ZERO is an older name of DOWN)
    "ROUND": np.round, "HALF_EVEN": np.round, "CEIL": np.ceil, "FLOOR": np.floor, "DOWN": np.trunc,
    "ROUND_TO_ZERO": np.trunc, "UP": lambda v: np.sign(v) * np.ceil(np.abs(v)),
    "HALF_UP": lambda v: np.sign(v) * np.floor(np.abs(v) + 0.5),
    "HALF_DOWN": lambda v: np.sign(v) * np.ceil(np.abs(v) - 0.5),
}


def qonnx_to_qcdq(g: Graph, findings: Findings) -> int:
    count, shifted, shared = 0, 0, {}
    for node in g.each(*QONNX_QUANTIZERS):
        if not is_qonnx_quantizer(node.op_type, node.domain):
            continue
        spec = _Spec(g, node)
        x = node.inputs[0]
        if g.is_const(x):
            out = _folded(g, node, spec, shared)
        else:
            out = _quantize_linear(g, node, spec, shared)
            shifted += bool(np.any(spec.zero_point != 0))
        read = [v for v in node.inputs if v is not None]
        g.replace(node.outputs[0], out, rename=True)
        g.remove(node)
        g.drop_if_unused(*read)
        count += 1
    if count:
        for domain in [d for d in g.model.opset_imports if is_qonnx_domain(d)]:
            if not any(n.domain == domain for n in g.graph):
                del g.model.opset_imports[domain]
        findings.notes.append(
            f"QONNX: its {count} Quant nodes are read as the QuantizeLinear / Clip / DequantizeLinear they define "
            "(constants as their integers, computed as QONNX computes them), and verified against that form"
            + (f"; {shifted} of them add a zero point other than 0 after rounding rather than before, which moves a "
               "value within a float32 ulp of a rounding tie by a step" if shifted else ""))
    return count


class _Spec:
    """One quantizer's parameters as the standard Q / DQ take them: a per-tensor or one-axis scale and zero point."""

    def __init__(self, g: Graph, node: Node):
        label = f"QONNX {node.op_type} {node.name or node.outputs[0].name!r}"
        self.name = node.name or "quant"
        values = [g.const(v) for v in (list(node.inputs) + [None] * 4)[1:4]]
        for what, value in zip(("scale", "zero point", "bit width"), values):
            if value is None:
                raise ModelError(f"{label}: its {what} is computed at run time (dynamic quantization), not a "
                                 "constant; QuantizeLinear takes a constant one")
        scale, zero_point, bits = (np.asarray(v, dtype=np.float64) for v in values)
        whole = bits.size == 1 and np.isfinite(bits.item()) and bits.item() == int(bits.item())
        if not whole or not 2 <= bits.item() <= 32:
            raise ModelError(f"{label}: bit width {bits.ravel()[:4].tolist()}, expected one integer from 2 to 32 "
                             "(1 bit is QONNX's BipolarQuant, which has no QDQ form)")
        if not np.all(np.isfinite(scale)) or not np.all(scale > 0):
            raise ModelError(f"{label}: its scale holds values that are not finite and positive "
                             f"({scale.ravel()[~(np.isfinite(scale.ravel()) & (scale.ravel() > 0))][:4].tolist()})")
        if not np.all(zero_point == np.round(zero_point)):
            raise ModelError(f"{label}: zero point {zero_point.ravel()[:4].tolist()} is not an integer; "
                             "QuantizeLinear's zero point is one")
        self.label, self.bits = label, int(bits.item())
        self.signed = bool(attr(node, "signed", 1))
        if node.attributes.get("narrow") is None:
            raise ModelError(f"{label}: 'narrow' is not set, and QONNX's specification (0) and its implementation "
                             "(1) default it differently: export it with the attribute set")
        narrow = bool(attr(node, "narrow"))
        mode = attr(node, "rounding_mode", "ROUND")
        self.mode = (mode.decode() if isinstance(mode, bytes) else str(mode)).upper()
        if self.mode not in ROUNDING:
            raise ModelError(f"{label}: rounding mode {self.mode!r}, expected one of {', '.join(ROUNDING)}")
        top = 2 ** (self.bits - 1) if self.signed else 2 ** self.bits
        self.lo = -top + narrow if self.signed else 0
        self.hi = top - 1 - (narrow and not self.signed)
        rank = g.rank(node.inputs[0])
        _check_broadcast(label, np.broadcast_shapes(scale.shape, zero_point.shape), node.inputs[0])
        self.axis, self.scale, self.zero_point = _one_axis(label, scale, zero_point, rank)
        if np.any(self.zero_point < self.lo) or np.any(self.zero_point > self.hi):
            raise ModelError(f"{label}: zero point {self.zero_point.ravel()[:4].tolist()} is outside its range "
                             f"[{self.lo}, {self.hi}]")
        self.scale_array, self.zero_array = values[0], values[1]  # as QONNX broadcasts them


def _check_broadcast(label: str, shape: tuple, x) -> None:
    """QONNX broadcasts scale and zero point over the input like numpy: where they cannot, the model is invalid."""
    dims = [] if x.shape is None else [d if isinstance(d, int) else None for d in x.shape]
    fits = len(shape) <= len(dims) and all(d in (1, n) or n is None for d, n in zip(shape[::-1], dims[::-1]))
    if x.shape is not None and not fits:
        raise ModelError(f"{label}: scale and zero point of shape {list(shape)} do not broadcast over its input "
                         f"{x.name!r} of shape {[d if d is not None else '?' for d in dims]}")


def _one_axis(label: str, scale: np.ndarray, zero_point: np.ndarray, rank: int | None):
    """(axis or None, 1-D float32 scale, 1-D zero point): QONNX broadcasts scale and zero point like numpy; the
    standard ops take them per tensor or along one axis."""
    shape = np.broadcast_shapes(scale.shape, zero_point.shape)
    wide = [i for i, d in enumerate(shape) if d > 1]
    if not wide:
        return None, np.array(scale.ravel()[0], np.float32), np.array(zero_point.ravel()[0])
    if len(wide) > 1 or rank is None:
        raise ModelError(f"{label}: scale and zero point of shape {list(shape)} "
                         + ("vary along several axes; QuantizeLinear takes one" if len(wide) > 1 else
                            "over an input of unknown rank; QuantizeLinear needs the axis"))
    axis = rank - len(shape) + wide[0]
    size = shape[wide[0]]
    flat = (np.broadcast_to(a, shape).reshape(size) for a in (scale, zero_point))
    return axis, next(flat).astype(np.float32), next(flat)


def _folded(g: Graph, node: Node, spec: _Spec, shared: dict):
    """A quantized constant: its integers, computed as QONNX computes them, behind a DequantizeLinear; past 8 bits
    int32 (a bias), or the float it means where int32 cannot say it (a zero point other than 0, unsigned 32 bits)."""
    x = g.const(node.inputs[0]).astype(np.float32)
    y = x / spec.scale_array.astype(np.float32) + spec.zero_array.astype(np.float32)
    if not np.all(np.isfinite(y)):
        raise ModelError(f"{spec.label}: constant {node.inputs[0].name!r} holds values that are not finite")
    q = ROUNDING[spec.mode](np.clip(y.astype(np.float64), spec.lo, spec.hi))  # float64: 2^31 - 1 stays in int32
    base = node.inputs[0].name
    if spec.bits > 8 and (np.any(spec.zero_point != 0) or spec.hi > np.iinfo(np.int32).max):
        value = ((q - spec.zero_array.astype(np.float32)) * spec.scale_array.astype(np.float32)).astype(np.float32)
        return g.add_const(base, value)
    dtype = np.int32 if spec.bits > 8 else np.int8 if spec.signed else np.uint8
    qparams = _qparams(g, spec, dtype, shared)
    return _dq(g, node, [g.add_const(base, q.astype(dtype)), *qparams[:1 if spec.bits > 8 else 2]], spec).outputs[0]


def _qparams(g: Graph, spec: _Spec, dtype, shared: dict) -> list:
    """The scale and zero point constants (one pair for the quantizers that share them, as QONNX's do)."""
    key = (spec.scale.tobytes(), spec.scale.shape, spec.zero_point.astype(dtype).tobytes(), np.dtype(dtype).str)
    if key not in shared:
        shared[key] = [g.add_const(f"{spec.name}_scale", spec.scale),
                       g.add_const(f"{spec.name}_zero_point", spec.zero_point.astype(dtype))]
    return shared[key]


def _quantize_linear(g: Graph, node: Node, spec: _Spec, shared: dict):
    """An activation's quantizer: QuantizeLinear, a Clip where QONNX's range is narrower than the 8-bit type's, and
    DequantizeLinear."""
    if spec.bits > 8:
        raise ModelError(f"{spec.label}: an activation quantized to {spec.bits} bits; onnxruntime's integer "
                         "kernels take 8 (export it with 8 or fewer)")
    if spec.mode not in ("ROUND", "HALF_EVEN"):
        raise ModelError(f"{spec.label}: an activation rounded {spec.mode}; QuantizeLinear rounds half to even "
                         "(QONNX's ROUND), the only rounding it has")
    if spec.axis is not None and g.opset < 13:
        raise ModelError(f"{spec.label}: a per-channel activation needs opset 13 (the model has {g.opset})")
    dtype = np.int8 if spec.signed else np.uint8
    qparams = _qparams(g, spec, dtype, shared)
    axis = {} if spec.axis is None else {"axis": spec.axis}
    q = g.add_node("QuantizeLinear", [node.inputs[0], *qparams], name=f"{spec.name}_quantize", **axis).outputs[0]
    info = np.iinfo(dtype)
    if (spec.lo, spec.hi) != (info.min, info.max):
        bounds = [g.add_const(f"{spec.name}_{end}", np.array(v, dtype))
                  for end, v in zip(("lo", "hi"), (spec.lo, spec.hi))]
        q = g.add_node("Clip", [q, *bounds], name=f"{spec.name}_clip").outputs[0]
    return _dq(g, node, [q, *qparams], spec).outputs[0]


def _dq(g: Graph, node: Node, inputs: list, spec: _Spec) -> Node:
    axis = {} if spec.axis is None else {"axis": spec.axis}
    return g.add_node("DequantizeLinear", inputs, name=f"{spec.name}_dequantize", **axis)
