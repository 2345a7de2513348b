"""Writing quantized operators: the pieces every QOperator pass shares.

Int32 biases, int8 weight inputs, the optional ``Relu`` / ``Clip`` (ReLU6) ``-> QuantizeLinear`` tail after an
op, and the replacement of a float op (and that tail) by one quantized node.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from .findings import Findings
from .ir_edits import Graph, Node, Value, attr, input_of
from .qdq import QTensor, QWeight, quantize_node_of, scalar

OFF_GRID = 1e-3  # a bias further than this from a whole int32 step (in steps) is reported as rounded
FLOAT32_EXACT = 2**24  # beyond this many steps a float32 bias cannot hold every whole step


def quantized_bias(g: Graph, node: Node, x: QTensor, w: QWeight, index: int | None,
                   findings: Findings, out: Node | None = None) -> Value | bool | None:
    """The int32 bias ``round(bias / (s_x * s_w))`` for ``node.inputs[index]``; False when there is none,
    None when the bias is not a constant or int32 cannot hold it (then ``findings.kept_float`` says why; a bias
    off the grid is noted in ``findings.rounded_biases``, and with ``out``, the QuantizeLinear that will read the
    layer, how far that rounding can move its output, in its steps: ``findings.bias_moves``)."""
    if index is None or input_of(node, index) is None:
        return False
    bias = g.const(node.inputs[index])
    if bias is None:
        return None
    if not np.isfinite(bias).all():
        findings.kept_float[node.name] = (node.op_type, "its bias holds NaN or inf")
        return None
    # scales along another axis (a QONNX scale of shape [3] on [64, 3, 3, 3])
    if w.scale.size not in (1, np.size(bias)):
        findings.kept_float[node.name] = (node.op_type, f"its weight's {w.scale.size} scales do not run along its "
                                                        f"{np.size(bias)} output channels")
        return None
    steps, off = bias_steps(g, bias, x, w)
    values = np.round(steps)
    if not on_grid(steps, off):
        findings.rounded_biases[node.name] = float(off.max())  # recal's exporters write them on the grid; others do not
        y_scale = g.const(input_of(out, 1)) if out is not None else None
        if y_scale is not None and y_scale.size == 1:
            moved = off * scalar(g, x.scale) * w.scale.astype(np.float64).reshape(-1) / float(y_scale.reshape(()))
            findings.bias_moves[out.outputs[0].name] = float(moved.max())
        if np.abs(steps).max() >= FLOAT32_EXACT:  # no float32 bias lies on a grid this fine
            findings.coarse_biases[node.name] = float(np.abs(steps).max())
    if np.abs(values).max(initial=0) > np.iinfo(np.int32).max:
        findings.kept_float[node.name] = (node.op_type, "its bias is beyond int32 in steps of input scale x weight "
                                                 f"scale (input scale {scalar(g, x.scale):.3g})")
        return None
    return g.add_const(node.inputs[index].name + "_int32", values.astype(np.int32))


def bias_steps(g: Graph, bias: np.ndarray, x: QTensor, w: QWeight) -> tuple[np.ndarray, np.ndarray]:
    """``bias`` in int32 steps of input scale x weight scale, and each one's distance from a whole step."""
    steps = np.asarray(bias, np.float64).reshape(-1) / (scalar(g, x.scale) * w.scale.astype(np.float64).reshape(-1))
    return steps, np.abs(steps - np.round(steps))


def on_grid(steps: np.ndarray, off: np.ndarray) -> bool:
    """Every step whole, to float32's rounding of an on-grid bias (recal's exporters write biases so)."""
    return not np.any(off > OFF_GRID + 1e-6 * np.abs(steps))


def weight_inputs(g: Graph, w: QWeight, channels_axis: int) -> tuple[Value, Value, Value] | None:
    """(q, scale, zero point) for an int8 weight, per tensor or per output channel, with one zero point for all of
    it (0 where symmetric; an asymmetric weight whose values minus its zero point leave int8 keeps its integers and
    its zero point, which the integer kernels subtract themselves). For CPUs whose int8 kernels saturate,
    :func:`recal_onnx.passes.uint8_weights.uint8_weights` shifts them later."""
    zero_points = np.unique(w.zero_point)
    if w.q.dtype != np.int8 or zero_points.size != 1:
        return None
    if w.scale.size != 1 and (w.axis != channels_axis or w.scale.size != w.q.shape[channels_axis]):
        return None
    scale = w.scale.reshape(-1) if w.scale.size != 1 else w.scale.reshape(())
    scale_const = g.add_const(w.dq.inputs[1].name + "_w", scale.astype(np.float32))
    return w.dq.inputs[0], scale_const, g.add_const("w_zero_point", np.full(scale.shape, zero_points[0], np.int8))


def clamp_bounds(g: Graph, node: Node) -> tuple[float | None, float | None] | None:
    """``(low, high)`` of a clamping activation (Relu: ``(0, None)``; Clip with constant bounds, ReLU6 among
    them), else None."""
    if node.op_type == "Relu":
        return 0.0, None
    if node.op_type != "Clip":
        return None
    if len(node.inputs) == 1 and (attr(node, "min") is not None or attr(node, "max") is not None):  # opset < 11
        return attr(node, "min"), attr(node, "max")
    bounds = []
    for i in (1, 2):
        bound = input_of(node, i)
        if bound is not None and not g.is_const(bound):
            return None
        bounds.append(float(np.asarray(g.const(bound)).reshape(-1)[0]) if bound is not None else None)
    return bounds[0], bounds[1]


def output_tail(g: Graph, value: Value) -> tuple[Node | None, Node | None]:
    """``(activation, quantize)`` after ``value``: an optional Relu or constant-bound Clip, then the
    QuantizeLinear that reads it."""
    act = g.only_consumer(value)
    if act is not None and act.inputs[0] is value and clamp_bounds(g, act) is not None:
        return act, quantize_node_of(g, act.outputs[0])
    return None, quantize_node_of(g, value)


def integer_bounds(g: Graph, act: Node, scale: Value, zero_point: Value,
                   on_grid: bool) -> list[tuple[str, int]] | None:
    """The clamp ``act`` (Relu, constant-bound Clip) does, on the integers of grid ``(scale, zero point)``:
    ``[("Max", low), ("Min", high)]``, each only where it cuts inside the integer type; None if it cannot.

    Before a QuantizeLinear (``on_grid=False``) it is exact for any bound: rounding is monotone, so
    ``Q(clip(y)) == clip(Q(y), Q(lo), Q(hi))``. After a DequantizeLinear (``on_grid=True``) a bound between grid
    points would give a float the integers cannot hold: None.
    """
    bounds = clamp_bounds(g, act)
    if bounds is None:
        return None
    scale, zp = scalar(g, scale), g.const(zero_point)
    info = np.iinfo(zp.dtype)
    ops = []
    for op, bound, limit in (("Max", bounds[0], info.min), ("Min", bounds[1], info.max)):
        if bound is None:
            continue
        steps = bound / scale + int(zp.reshape(-1)[0])
        if (steps <= limit + 1e-4) if op == "Max" else (steps >= limit - 1e-4):
            continue  # beyond what the integers hold: nothing to clamp
        if on_grid and abs(steps - np.rint(steps)) > 1e-4:
            return None
        value = int(np.clip(np.rint(steps), info.min, info.max))
        if value != limit:
            ops.append((op, value))
    return ops


def clamp_integers(g: Graph, act: Node, source: Value, ops: list[tuple[str, int]], dtype: np.dtype) -> Value:
    """``ops`` (from :func:`integer_bounds`) applied to the integers ``source`` as ``Max`` / ``Min`` nodes.
    Returns the clamped tensor (``source`` if ``ops`` is empty)."""
    out = source
    for op, value in ops:
        bound = g.add_const(f"{act.name or 'clamp'}_{op.lower()}", np.array(value, dtype))
        out = g.add_node(op, [out, bound], name=f"{act.name}_{op.lower()}_int8").outputs[0]
    return out


def replace_with_quantized(g: Graph, replaced: list[Node], act: Node | None, q: Node, op_type: str,
                           inputs: list[Value | None], *, name: str, domain: str = "",
                           then: Callable[[Value], Value] | None = None, **attrs) -> None:
    """Replace ``replaced`` (with ``act`` and ``q``) by one ``op_type`` node that writes ``q``'s integers
    (passed through ``then`` when given: a reshape back to the layer's shape).

    A clamping activation costs nothing where the output type's own range is the clamp (a ReLU with the
    lowest zero point, a ReLU6 whose 6 is beyond the top); otherwise it becomes ``Max`` / ``Min`` with the
    bound's integer on the integers.
    """
    clamp = integer_bounds(g, act, q.inputs[1], q.inputs[2], on_grid=False) if act is not None else []
    dtype = g.const(q.inputs[2]).dtype
    out = g.add_node(op_type, inputs, name=name, domain=domain, **attrs).outputs[0]
    out = clamp_integers(g, act, out, clamp, dtype)
    if then is not None:
        out = then(out)
    g.replace(q.outputs[0], out, rename=True)
    g.remove(*replaced, *(n for n in (act, q) if n is not None))
