"""A second, independent judge of what a reader made of a file onnxruntime cannot run (QONNX's ``Quant``): the
format's own definition, written in standard ONNX float ops on the original file and evaluated by onnxruntime,
compared with the reader's QDQ model quantizer by quantizer, before anything else runs.

Verification compares the converted model with the reader's model, so it cannot see a misreading (a 32-bit bias
that wrapped to -2^31 converts and verifies "exact"). This judge can: every ``Quant`` output must equal its
definition, a constant's exactly (to float32's rounding of the same product), an activation's within one step on
at most :data:`TIES` of its values (a non-zero zero point added after rounding moves a value within a float32 ulp of
a tie by a step).

QONNX defines ``Quant(x, scale, zeropt, bitwidth) = (rnd(clip(x / scale + zeropt, lo, hi)) - zeropt) * scale``.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
from onnx import helper, numpy_helper

from .errors import ModelError
from .input_checks import is_qonnx_domain, is_qonnx_quantizer

TIES = 1e-3  # the share of an activation's values that may differ by one step (ties, see the module)
SAMPLES = 4  # generated samples the activations are compared on


class _Nodes:
    """Standard ONNX nodes appended to ``nodes``, each output named apart by ``prefix``."""

    def __init__(self, nodes: list, prefix: str):
        self.nodes, self.prefix = nodes, prefix

    def __call__(self, op: str, inputs: list[str], output: str | None = None, **attrs) -> str:
        output = output or f"{self.prefix}{op}{len(self.nodes)}"
        self.nodes.append(helper.make_node(op, inputs, [output], **attrs))
        return output


def qonnx_definition(model: onnx.ModelProto) -> tuple[onnx.ModelProto, dict[str, tuple[str, bool]]]:
    """``model`` with every QONNX ``Quant`` written as its definition in standard float ops (same output names),
    and per Quant output ``(its scale's name, whether its input is a constant)``."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    constants = set(_constants(out))
    nodes, quants = [], {}
    for i, node in enumerate(out.graph.node):
        if not is_qonnx_quantizer(node.op_type, node.domain):
            nodes.append(node)
            continue
        x, scale, zero, bits = (list(node.input) + [""] * 4)[:4]
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        signed, narrow = int(attrs.get("signed", 1)), int(attrs.get("narrow", 0))
        mode = attrs.get("rounding_mode", b"ROUND")
        mode = (mode.decode() if isinstance(mode, bytes) else str(mode)).upper()
        p = f"__qonnx_def_{i}_"
        out.graph.initializer.extend(numpy_helper.from_array(np.array(v, np.float32), p + name) for name, v in
                                     (("one", 1.0), ("two", 2.0), ("half", 0.5), ("narrow", float(narrow))))
        n = _Nodes(nodes, p)
        b = n("Cast", [bits], to=onnx.TensorProto.FLOAT)
        if signed:  # lo, hi from the bit width: -2^(b-1) + narrow, 2^(b-1) - 1
            top = n("Pow", [p + "two", n("Sub", [b, p + "one"])])
            lo, hi = n("Add", [n("Neg", [top]), p + "narrow"]), n("Sub", [top, p + "one"])
        else:  # 0, 2^b - 1 - narrow
            lo = n("Sub", [p + "narrow", p + "narrow"])
            hi = n("Sub", [n("Sub", [n("Pow", [p + "two", b]), p + "one"]), p + "narrow"])
        clipped = n("Min", [n("Max", [n("Add", [n("Div", [x, scale]), zero]), lo]), hi])
        n("Mul", [n("Sub", [_rounded(n, clipped, mode, p), zero]), scale], output=node.output[0])
        quants[node.output[0]] = (scale, x in constants)
    del out.graph.node[:]
    out.graph.node.extend(nodes)
    for opset in [o for o in out.opset_import if is_qonnx_domain(o.domain)]:
        out.opset_import.remove(opset)
    return out, quants


def _constants(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    """Initializers and ``Constant`` nodes' tensors, by name."""
    found = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    for node in model.graph.node:
        if node.op_type == "Constant" and node.attribute and node.attribute[0].type == onnx.AttributeProto.TENSOR:
            found[node.output[0]] = numpy_helper.to_array(node.attribute[0].t)
    return found


def _rounded(n: _Nodes, c: str, mode: str, p: str) -> str:
    if mode in ("ROUND", "HALF_EVEN"):
        return n("Round", [c])
    if mode in ("FLOOR", "CEIL"):
        return n(mode.capitalize(), [c])
    sign, size = n("Sign", [c]), n("Abs", [c])
    magnitude = {"DOWN": lambda: n("Floor", [size]), "ROUND_TO_ZERO": lambda: n("Floor", [size]),
                 "UP": lambda: n("Ceil", [size]), "HALF_UP": lambda: n("Floor", [n("Add", [size, p + "half"])]),
                 "HALF_DOWN": lambda: n("Ceil", [n("Sub", [size, p + "half"])])}[mode]()
    return n("Mul", [sign, magnitude])


def judge_qonnx_reading(original: onnx.ModelProto, read: onnx.ModelProto, label: str,
                        inputs: dict[str, np.ndarray] | None = None,
                        shapes: dict[str, list[int]] | None = None) -> str:
    """Refuse (:class:`ModelError`) where ``read`` (the reader's QDQ model) differs from QONNX's definition of
    ``original`` on any Quant output beyond rounding: a reader defect, never the user's. Judged on the first
    :data:`SAMPLES` of the user's ``inputs`` (generated, with ``shapes``, where None). Returns '' when judged, else
    a note saying why it could not be."""
    definition, quants = qonnx_definition(original)
    names = [name for name in quants if any(name in n.output for n in read.graph.node)]
    if not names:
        return ""
    try:
        expected, got = _run_both((definition, names), (read, names), read, inputs, shapes)
    except Exception as exc:  # noqa: BLE001 - inputs the model does not run on: verification refuses them itself
        return (f"QONNX: the reading could not be compared with QONNX's definition on these inputs "
                f"({' '.join(str(exc).split())[:200]})")
    scales = _constants(definition)
    _compare(label, "QONNX Quant", names, expected, got,
             [_step(scales.get(quants[n][0]), w.shape) for n, w in zip(names, expected)],
             [quants[n][1] for n in names], "QONNX's own definition")
    return ""


def _run_both(first: tuple[onnx.ModelProto, list[str]], second: tuple[onnx.ModelProto, list[str]],
              read: onnx.ModelProto, inputs: dict[str, np.ndarray] | None, shapes: dict[str, list[int]] | None):
    """The named tensors of two models (each ``(model, names)``), run as written on the first :data:`SAMPLES` of
    ``inputs`` (generated for ``read`` with ``shapes`` where None)."""
    from .verify import _with_outputs, reference_session, run_batches
    from .verify_inputs import fixed_batch, generated_inputs

    fixed = fixed_batch(read)
    feeds = ({k: v[:max(SAMPLES, fixed or 0)] if np.ndim(v) else v for k, v in inputs.items()} if inputs is not None
             else generated_inputs(read, SAMPLES, shapes=shapes))
    found = []
    for model, names in (first, second):
        outputs = [o.name for o in model.graph.output]
        values = run_batches(reference_session(_with_outputs(model, names)), feeds, fixed)
        by_name = dict(zip(outputs + [n for n in names if n not in outputs], values))
        found.append([by_name[n] for n in names])
    return found


def _compare(label: str, what: str, names: list[str], expected: list, got: list, steps: list, constant: list[bool],
             definition: str) -> None:
    """Each reader tensor against its definition: a constant's exactly (to float32's rounding of the same product),
    an activation's within one step on at most :data:`TIES` of its values; else the :class:`ModelError` of a reader
    defect, naming the tensor."""
    for name, want, have, step, fixed in zip(names, expected, got, steps, constant):
        gap = np.abs(want.astype(np.float64) - have.astype(np.float64)) / step
        if fixed:  # the same product in float32, to its rounding
            far = gap > 1e-3 + 1e-6 * np.abs(want) / step
            share = 0.0
        else:
            far = gap > 1 + 1e-3
            share = float(np.count_nonzero(gap > 1e-3)) / max(gap.size, 1)
        if far.any() or share > TIES:
            where = int(np.argmax(gap))
            raise ModelError(
                f"{label}: recal's reading of {what} {name!r} differs from {definition} (evaluated on the original "
                f"file) by up to {float(gap.max()):.4g} steps (value {have.ravel()[where]:.6g} where the definition "
                f"gives {want.ravel()[where]:.6g}); this is a defect of the converter's reader, not of your model: "
                "nothing was written")


def _step(scale: np.ndarray | None, shape: tuple) -> np.ndarray:
    """The quantizer's step at each value (its scale broadcast over the output); a scale that is no constant, or does
    not broadcast, was refused by the reader already: then a step of 1 stands in (an absolute comparison)."""
    try:
        return np.maximum(np.broadcast_to(np.abs(scale).astype(np.float64), shape), 1e-30)
    except (TypeError, ValueError, AttributeError):
        return np.ones(shape)


def aimet_definition(model: onnx.ModelProto, encodings: list) -> tuple[onnx.ModelProto, dict[str, tuple]]:
    """The float ``model`` with AIMET's simulation of each integer encoding written in standard float ops after its
    tensor, ``(clip(round(x / scale) - offset, 0, 2**bw - 1) + offset) * scale`` (per channel along the axis its
    layer's output channels take), its readers reading that; per encoded tensor ``(its simulated value's name, the
    scale broadcast as it, whether it is a parameter)``."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    constants = _constants(out)
    readers = _readers(out)
    nodes, simulated = [], {}
    for i, e in enumerate(x for x in encodings if not x.floating):
        p = f"__aimet_def_{i}_"
        shape = [1] * np.ndim(constants.get(e.name, 0))  # an activation's: one scale
        if e.scales.size > 1:
            shape[_channel_axis(e, constants.get(e.name), readers.get(e.name, []))] = -1
        scale, offset = e.scales.astype(np.float32).reshape(shape), e.offsets.astype(np.float32).reshape(shape)
        out.graph.initializer.extend(numpy_helper.from_array(v, p + k) for k, v in (
            ("scale", scale), ("offset", offset), ("lo", np.float32(0)), ("hi", np.float32(2 ** e.bits - 1))))
        n = _Nodes(nodes, p)
        clipped = n("Min", [n("Max", [n("Sub", [n("Round", [n("Div", [e.name, p + "scale"])]), p + "offset"]),
                                     p + "lo"]), p + "hi"])
        value = n("Mul", [n("Add", [clipped, p + "offset"]), p + "scale"], output=p + "value")
        simulated[e.name] = (value, scale, e.param)
    for node in out.graph.node:  # readers read the simulated value
        for j, name in enumerate(node.input):
            if name in simulated:
                node.input[j] = simulated[name][0]
    out.graph.node.extend(nodes)
    model = ir.serde.deserialize_model(out)
    model.graph.sort()  # each definition after the node that makes its tensor
    return ir.serde.serialize_model(model), simulated


def _readers(model: onnx.ModelProto) -> dict[str, list[tuple[onnx.NodeProto, int]]]:
    found: dict[str, list] = {}
    for node in model.graph.node:
        for j, name in enumerate(node.input):
            found.setdefault(name, []).append((node, j))
    return found


def _channel_axis(e, constant: np.ndarray | None, readers: list) -> int:
    """The axis of a parameter's channels: its layer's output channels (Conv 0, ConvTranspose 1, Gemm by ``transB``,
    MatMul the last), else the one axis as long as its encodings; a per-channel activation was refused already."""
    for node, j in readers:
        if j == 1 and constant is not None:
            if node.op_type == "Conv":
                return 0
            if node.op_type == "ConvTranspose":
                return 1
            if node.op_type == "Gemm":
                return 0 if any(a.name == "transB" and a.i for a in node.attribute) else 1
            if node.op_type == "MatMul":
                return constant.ndim - 1
    sized = [a for a, d in enumerate(np.shape(constant)) if d == e.scales.size]
    if len(sized) != 1:
        raise ValueError(f"no one channel axis for {e.name!r}")
    return sized[0]


def judge_aimet_reading(original: onnx.ModelProto, read: onnx.ModelProto, encodings: list, label: str,
                        inputs: dict[str, np.ndarray] | None = None,
                        shapes: dict[str, list[int]] | None = None) -> str:
    """Refuse (:class:`ModelError`) where ``read`` (the float model with the encodings read as QDQ) differs from AIMET's
    simulation of ``original`` (:func:`aimet_definition`) on any encoded tensor beyond rounding, as each of its
    readers reads it. Returns '' when judged, else a note saying why it could not be."""
    try:
        definition, simulated = aimet_definition(original, encodings)
    except ValueError as exc:
        return f"AIMET encodings: the reading was not compared with AIMET's simulation ({exc})"
    read_nodes = {n.name: n for n in read.graph.node if n.name}
    read_outputs = {o.name for o in read.graph.output}
    pairs = []  # (tensor, the definition's name for it, the reader's)
    for node in original.graph.node:
        for j, name in enumerate(node.input):
            twin = read_nodes.get(node.name)
            if name in simulated and twin is not None and j < len(twin.input) and twin.input[j]:
                pairs.append((name, simulated[name][0], twin.input[j]))
    given = {i.name for i in original.graph.input}  # an input that is also an output stays as given (said apart)
    for output in original.graph.output:
        if output.name in simulated and output.name in read_outputs and output.name not in given:
            pairs.append((output.name, simulated[output.name][0], output.name))
    pairs = list(dict.fromkeys(pairs))
    if not pairs:
        return ""
    try:
        expected, got = _run_both((definition, [d for _, d, _ in pairs]), (read, [r for _, _, r in pairs]), read,
                                  inputs, shapes)
    except Exception as exc:  # noqa: BLE001 - inputs the model does not run on: verification refuses them itself
        return (f"AIMET encodings: the reading could not be compared with AIMET's simulation on these inputs "
                f"({' '.join(str(exc).split())[:200]})")
    _compare(label, "the AIMET encoding of", [t for t, _, _ in pairs], expected, got,
             [_step(simulated[t][1], w.shape) for (t, _, _), w in zip(pairs, expected)],
             [simulated[t][2] for t, _, _ in pairs], "AIMET's simulation")
    return ""
