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
from onnx import helper, numpy_helper

from .input_checks import ModelError, is_qonnx_domain, is_qonnx_quantizer

TIES = 1e-3  # the share of an activation's values that may differ by one step (ties, see the module)
SAMPLES = 4  # generated samples the activations are compared on


def qonnx_definition(model: onnx.ModelProto) -> tuple[onnx.ModelProto, dict[str, tuple[str, bool]]]:
    """``model`` with every QONNX ``Quant`` written as its definition in standard float ops (same output names),
    and per Quant output ``(its scale's name, whether its input is a constant)``."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    constants = {t.name for t in out.graph.initializer} | {o for n in out.graph.node if n.op_type == "Constant"
                                                          for o in n.output}
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
        # lo, hi from the bit width at run time: signed: -2^(b-1) + narrow, 2^(b-1) - 1; unsigned: 0, 2^b - 1 - narrow
        two = p + "two"
        out.graph.initializer.extend([numpy_helper.from_array(np.array(2.0, np.float32), two),
                                      numpy_helper.from_array(np.array(1.0, np.float32), p + "one"),
                                      numpy_helper.from_array(np.array(float(narrow), np.float32), p + "narrow")])
        n = lambda op, ins, **kw: nodes.append(helper.make_node(op, ins, [p + op + str(len(nodes))], **kw)) \
            or nodes[-1].output[0]
        b = n("Cast", [bits], to=onnx.TensorProto.FLOAT)
        if signed:
            half = n("Pow", [two, n("Sub", [b, p + "one"])])
            lo, hi = n("Add", [n("Neg", [half]), p + "narrow"]), n("Sub", [half, p + "one"])
        else:
            lo = n("Sub", [p + "narrow", p + "narrow"])
            hi = n("Sub", [n("Sub", [n("Pow", [two, b]), p + "one"]), p + "narrow"])
        y = n("Add", [n("Div", [x, scale]), zero])
        c = n("Min", [n("Max", [y, lo]), hi])
        r = _rounded(n, c, mode, p)
        nodes.append(helper.make_node("Mul", [n("Sub", [r, zero]), scale], [node.output[0]]))
        quants[node.output[0]] = (scale, x in constants)
        out.graph.initializer.append(numpy_helper.from_array(np.array(0.5, np.float32), p + "half"))
    del out.graph.node[:]
    out.graph.node.extend(nodes)
    for opset in list(out.opset_import):
        if is_qonnx_domain(opset.domain):
            out.opset_import.remove(opset)
    return out, quants


def _rounded(n, c: str, mode: str, p: str) -> str:
    if mode in ("ROUND", "HALF_EVEN"):
        return n("Round", [c])
    if mode == "FLOOR":
        return n("Floor", [c])
    if mode == "CEIL":
        return n("Ceil", [c])
    sign, size = n("Sign", [c]), n("Abs", [c])
    inner = {"DOWN": lambda: n("Floor", [size]), "ROUND_TO_ZERO": lambda: n("Floor", [size]),
             "UP": lambda: n("Ceil", [size]), "HALF_UP": lambda: n("Floor", [n("Add", [size, p + "half"])]),
             "HALF_DOWN": lambda: n("Ceil", [n("Sub", [size, p + "half"])])}[mode]()
    return n("Mul", [sign, inner])


def judge_qonnx_reading(original: onnx.ModelProto, read: onnx.ModelProto, label: str) -> None:
    """Refuse (:class:`ModelError`) where ``read`` (the reader's QDQ model) differs from QONNX's definition of
    ``original`` on any Quant output beyond rounding; a reader defect, never the user's."""
    from .verify import _with_outputs, reference_session, run_batches
    from .verify_inputs import fixed_batch, generated_inputs

    definition, quants = qonnx_definition(original)
    names = [name for name in quants if any(name in n.output for n in read.graph.node)]
    if not names:
        return
    try:
        feeds, fixed = generated_inputs(read, SAMPLES), fixed_batch(read)
        expected = run_batches(reference_session(_with_outputs(definition, names)), feeds, fixed)
        got = run_batches(reference_session(_with_outputs(read, names)), feeds, fixed)
        outputs = [o.name for o in read.graph.output]
        expected, got = (dict(zip(outputs + [n for n in names if n not in outputs], values)) for values in
                         (expected, got))
        expected, got = [expected[n] for n in names], [got[n] for n in names]
    except ModelError:
        raise
    except Exception:  # noqa: BLE001 - generated inputs the model does not run on (verification says so on its own)
        return
    scales = {t.name: numpy_helper.to_array(t) for t in definition.graph.initializer}
    for name, want, have in zip(names, expected, got):
        scale_name, constant = quants[name]
        scale = scales.get(scale_name)
        step = np.broadcast_to(np.abs(scale), want.shape) if scale is not None and scale.size and \
            np.broadcast_shapes(scale.shape, want.shape) == want.shape else np.full(want.shape, np.inf)
        gap = np.abs(want.astype(np.float64) - have.astype(np.float64)) / np.maximum(step, 1e-30)
        if constant:
            far = gap > 1e-3 + 1e-6 * np.abs(want) / np.maximum(step, 1e-30)
            share = 0.0 if not far.any() else 1.0
        else:
            far = gap > 1 + 1e-3
            share = float(np.count_nonzero(gap > 1e-3)) / max(gap.size, 1)
        if far.any() or share > TIES:
            worst = float(gap.max())
            where = int(np.argmax(gap))
            raise ModelError(
                f"{label}: recal's reading of QONNX Quant {name!r} differs from QONNX's own definition "
                f"(evaluated on the original file) by up to {worst:.4g} steps (value {have.ravel()[where]:.6g} where "
                f"the definition gives {want.ravel()[where]:.6g}); this is a defect of the converter's reader, not "
                "of your model: nothing was written")
