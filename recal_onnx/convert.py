"""``quantize_qat_export``: a QAT (QuantizeLinear/DequantizeLinear) ONNX model to a fully quantized one.

The passes rewrite an ``onnx_ir`` model (:mod:`recal_onnx.ir_edits`), in the order :mod:`recal_onnx.pipeline`
declares; the driver then removes dead nodes and initializers, sorts the graph, and runs ``onnx.checker`` and shape
inference. What the passes find beyond their rewrites (layers kept float and why, thinned channels, rounded biases)
is a :class:`~recal_onnx.findings.Findings` record the result reports from.

How weights are stored follows the ``target`` (:mod:`recal_onnx.targets`), never the converting CPU: a model
trained with ``reduce_range: true`` (7-bit weights) is int8 throughout, exact and fast on every CPU; an 8-bit one
keeps int8 weights for ``x86-vnni`` / ``arm64``, stores its layers with weights beyond +-64 as uint8 for
``x86-avx2``, and for the default ``any`` writes both: the int8 model, and beside it its uint8-weight twin for x86
CPUs without VNNI (:mod:`recal_onnx.twin`).

Whatever stays float between a DequantizeLinear and a QuantizeLinear is listed in a
:class:`UnconvertedOpsWarning`. With ``verify`` both models run in onnxruntime on the same inputs;
beyond tolerance nothing is written and :class:`VerificationError` says by how much.
"""

from __future__ import annotations

import logging
import math
import os
import time
import warnings
from collections import Counter
from pathlib import Path

import numpy as np
import onnx

from recal_core.errors import ThinningWarning

from . import cpu
from .findings import Findings
from .float_reasons import display_name, float_reason
from .float_report import QDQ_FUSIBLE, float_compute, float_islands, module_paths, qoperator_kernel
from .ir_edits import Graph
from .aimet_encodings import load_encodings
from .errors import ModelError, NonFiniteReferenceError, UnconvertedOpsWarning, VerificationError
from .input_checks import check_input, nonfinite_initializers
from .model_file import infer_shapes_in_place, load_model, refuse_overwriting
from .result import ConversionResult
from .passes import CHANNEL_BLOCK, exact_on_this_cpu, float32_reference, saturating_layers
from .pipeline import Options, read_input, run_pipeline
from .save import save_models_atomically
from .targets import DEFAULT_TARGET, WeightChoice, choose_weights
from .twin import INT8_CPUS, TWIN_SAMPLES, avx2_twin, mark, twin_differs, twin_path
from .verify import generated_inputs, runtime_refusal, verify_models
from .verify_inputs import check_input_names, chosen_dimensions

log = logging.getLogger(__name__)

FORMATS = ("qoperator", "qdq")
MAX_LISTED = 20  # nodes the float warning names, one per line; result.float_nodes holds them all




def quantize_qat_export(model_or_path: str | os.PathLike | onnx.ModelProto,
                        output_path: str | os.PathLike | None = None, format: str = "qoperator", verify: bool = True,
                        inputs: dict[str, np.ndarray] | None = None,
                        tolerance: float | None = None, min_agreement: float | None = None,
                        thin: bool = True, verify_inputs: dict[str, np.ndarray] | None = None,
                        weight_type: str = "auto", channel_block: int = CHANNEL_BLOCK,
                        target: str = DEFAULT_TARGET, accuracy_level: int = 0,
                        keep_exporter_metadata: bool = False,
                        encodings: str | os.PathLike | dict | None = None,
                        input_shapes: dict[str, list[int]] | None = None) -> ConversionResult:
    """Convert a QAT ONNX model into a fully quantized one (``qoperator``) or a folded, clean QDQ one.

    Args:
        model_or_path: the QAT (QDQ) model or its path (QONNX's ``Quant`` nodes are read as the QDQ they
            define); never modified.
        output_path: where to write the result (atomically; never the input file), or None.
        format: ``"qoperator"`` (QLinearConv, QGemm, ...) or ``"qdq"`` (folded, clean QDQ).
        verify: compare the result with the input in onnxruntime before anything is written.
        inputs: the verification's inputs by name (generated when None).
        tolerance: the largest max-abs difference accepted end to end (default: see below).
        min_agreement: the smallest argmax agreement accepted (not enforced by default).
        thin: remove the channels filter pruning left dead.
        verify_inputs: another name for ``inputs``.
        weight_type: ``"auto"`` (the target's choice), ``"int8"`` or ``"uint8"``.
        channel_block: thinned channel counts are a multiple of this.
        target: the CPUs the model is for (:mod:`recal_onnx.targets`).
        accuracy_level: how ``MatMulNBits`` (weight-only layers) computes: 0 (default) in float, exactly the QAT
            model's values; 4 with the input quantized to int8 per block, faster where the CPU has int8 dot
            products, verified with the same tolerance; 1-3 as onnxruntime defines them.
        keep_exporter_metadata: keep the torch exporter's per-node record (module path, stack trace), which is
            dropped by default (:mod:`recal_onnx.passes.drop_exporter_metadata`; ``rewrites["drop_exporter_metadata"]``:
            bytes).
        input_shapes: per input name, the shape generated verification inputs take (its first dimension the
            batch) where the model leaves dimensions open; by default they get sizes that exercise the model
            (:func:`recal_onnx.verify_inputs.open_dimension`). Real inputs (``inputs``) are better still.
        encodings: with a float model, AIMET's encodings (``QuantizationSimModel.export``'s ``.encodings`` file or
            its dict): the QDQ model they mean together is converted (:mod:`recal_onnx.passes.encodings_to_qdq`).

    Returns:
        A :class:`ConversionResult`: the model, its path, the rewrites made, what stays float and why, the
        verification's figures, and which weight form was written and why.

    Raises:
        VerificationError: the result differs from the input beyond tolerance (nothing is written).
        ModelError: the input is not a QAT model this converter can read, run or convert.

    ``model_or_path`` is never modified; ``output_path`` (optional) is written atomically and may not
    be the input file. ``inputs`` (or its other name ``verify_inputs``) feeds the verification (generated
    when absent: integer inputs cover the table they index, masks are ones); ``tolerance`` is the largest
    max-abs-difference accepted (default: 3 quantization steps of a quantized output, 10% of the reference
    outputs' range for a float one, or, where every integer op matches op by op, as far as the input model's own
    outputs move when each activation quantizer's input moves by 8 float32 ulps: :mod:`recal_onnx.verify`).
    Argmax agreement (2-D outputs) is always reported; it is enforced only with ``min_agreement`` (on generated
    inputs a model's near-tied logits flip on rounding alone, and a flip on a clear margin already exceeds the
    tolerance). ``thin`` removes the channels filter
    pruning left dead (exactly zero, or read by no one) where the channel-coupling rules allow: the
    outputs stay the same, the multiply-adds go down (``rewrites["thin_channels"]``: channels removed); the
    channels kept are a multiple of ``channel_block`` (dead ones kept to make it up: onnxruntime's int8
    kernels run other counts up to 3x slower; 1 removes every dead channel).
    ``target``: the CPUs the model is for (:mod:`recal_onnx.targets`): ``"any"`` (default: the int8 model, fast and
    exact with VNNI / AMX and on Arm, and where weights pass +-64 its twin for x86 without VNNI beside it,
    ``<name>.x86-avx2.onnx``, ``result.avx2_path`` / ``result.avx2_model``),
    ``"x86-avx2"``, ``"x86-vnni"``, ``"arm64"`` or ``"native"`` (this CPU's kind, said in the result). It
    decides how weights beyond +-64 are stored; a model trained with ``reduce_range: true`` has none, and is int8
    for every target. ``weight_type`` (``"auto"``: the target's choice; ``"int8"``; ``"uint8"``) overrides it.
    ``result.weights_note`` says which form was written and why. Verification on a CPU that saturates int8
    weights runs the model's uint8-weight twin (the values the target computes), and says so.
    """
    if format not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS}, got {format!r}")
    if not isinstance(channel_block, int) or isinstance(channel_block, bool) or channel_block < 1:
        raise ValueError(f"channel_block must be an integer >= 1, got {channel_block!r}")
    if accuracy_level not in (0, 1, 2, 3, 4) or isinstance(accuracy_level, bool):
        raise ValueError(f"accuracy_level must be 0, 1, 2, 3 or 4 (onnxruntime's MatMulNBits), got {accuracy_level!r}")
    choice = choose_weights(target, weight_type)
    if inputs is not None and verify_inputs is not None:
        raise ValueError("give the verification inputs once: inputs= or verify_inputs=, not both")
    inputs = verify_inputs if inputs is None else inputs
    for name, value, upper in (("tolerance", tolerance, math.inf), ("min_agreement", min_agreement, 1.0)):
        if value is not None and not (isinstance(value, (int, float)) and 0 <= value <= upper
                                      and not math.isnan(value)):
            raise ValueError(f"{name} must be a number in [0, {upper:g}], got {value!r}")
    started = time.perf_counter()
    given, from_path = inputs is not None, isinstance(model_or_path, (str, os.PathLike))
    model, reads = load_model(model_or_path)
    if encodings is not None:
        if not isinstance(encodings, dict):
            reads.add(Path(encodings))  # never the output either
        encodings = load_encodings(encodings)
    if output_path is not None:
        refuse_overwriting(Path(output_path), reads)
        if choice.twin:
            refuse_overwriting(twin_path(output_path), reads)
    label = str(model_or_path) if from_path else "the model"
    check_input(model, label, encodings=encodings is not None)
    for what, named in (("inputs", inputs), ("input_shapes", input_shapes)):
        check_input_names(model, named, what, label)
    if from_path:
        reference: onnx.ModelProto | str = str(model_or_path)  # the file stays as it is; no second copy
    else:
        reference = model_or_path
        model = onnx.ModelProto()
        model.CopyFrom(model_or_path)  # never modify the caller's model
    try:  # QONNX, AIMET's encodings, float16: verified as the QDQ model they mean, computing in float32
        model, reference, notes = read_input(model, reference, label, encodings, inputs, input_shapes)
        if verify and inputs is None:
            inputs = generated_inputs(model, shapes=input_shapes)
        return _convert(model, float32_reference(model) or reference, output_path, format, verify, inputs, tolerance,
                        min_agreement, started, thin=thin, choice=choice, channel_block=channel_block,
                        accuracy_level=accuracy_level, keep_exporter_metadata=keep_exporter_metadata, notes=notes,
                        given=given)
    except ModelError as exc:  # a pass's, which names the node: the file too
        if str(exc).startswith(label):
            raise
        raise ModelError(f"{label}: {exc}") from None
    except (VerificationError, OSError, MemoryError):
        raise
    except Exception as exc:  # a malformed model must end in one clear error, not a traceback
        own = runtime_refusal(reference, inputs)
        if own is not None:  # the input does not run on these inputs: say so in onnxruntime's words
            if given or not chosen_dimensions(model):  # every size but the batch the file's own: its defect
                raise ModelError(f"{label} does not run in onnxruntime itself, as written"
                                 f"{', on the given inputs' if given else ''}: {own}") from exc
            shapes = ", ".join(f"{k} {list(np.shape(v))}" for k, v in (inputs or {}).items())
            raise ModelError(f"{label} as written does not run in onnxruntime on the verification's generated inputs "
                             f"({shapes or 'none could be made'}): {own}; give inputs of the shapes it takes: "
                             "--input-shape NAME=1,3,224,224 or --inputs FILE.npz (input_shapes= or inputs= in the "
                             "API)") from exc
        integer = Counter(n.op_type for n in model.graph.node if qoperator_kernel(n.op_type))
        if integer:  # a QOperator model (quantize_static's QOperator format) passes through, here into a failure
            kinds = ", ".join(f"{op} x{n}" for op, n in integer.most_common())
            raise ModelError(f"{label} is already an integer (QOperator) model ({kinds}), and passing it through "
                             f"failed: {' '.join(str(exc).split())[:300]}; the converter takes the QDQ form "
                             "(QuantizeLinear / DequantizeLinear around float ops: quantize_static(..., "
                             "quant_format=QuantFormat.QDQ), or the QAT export)") from exc
        raise ModelError(f"cannot convert {label}: {type(exc).__name__}: {' '.join(str(exc).split())[:500]}") from exc


def _convert(model, reference, output_path, format, verify, inputs, tolerance, min_agreement,
             started, *, thin: bool, choice: WeightChoice, channel_block: int,
             accuracy_level: int = 0, keep_exporter_metadata: bool = False, notes: list[str],
             given: bool = True) -> ConversionResult:
    infer_shapes_in_place(model)
    g = Graph(model)
    findings = Findings(notes=list(notes))
    modules = module_paths(g)  # from the exporter's record, which the pipeline's last step drops
    rewrites = run_pipeline(g, Options(format, choice.weight_type, thin, channel_block, accuracy_level,
                                       keep_exporter_metadata), findings)
    # layers with weights beyond +-64: those still int8, and those uint8_weights shifted (exactly those it takes)
    saturating = saturating_layers(g) + rewrites.get("uint8_weights", 0)
    positions = {node: i for i, node in enumerate(g.nodes)}
    islands = float_islands(g, QDQ_FUSIBLE if format == "qdq" else set())
    why = {display_name(n, positions[n]): findings.kept_float[n.name][1] if n.name in findings.kept_float
           else float_reason(g, n) for n in islands}
    unconverted = [(n.op_type, display_name(n, positions[n])) for n in islands]
    present = {node.name for node in g.nodes} - {n.name for n in islands}
    unconverted += [(op, name) for name, (op, _) in findings.kept_float.items() if name in present]
    why.update({name: reason for name, (_, reason) in findings.kept_float.items() if name in present})
    reasons = {name: f" ({reason})" for name, reason in why.items()}
    output_steps = _output_quanta(g)
    rewrites["remove_dead"] = g.remove_dead()
    model = g.commit()
    infer_shapes_in_place(model, check=True)
    if unconverted:
        lines = [f"  {op} {name!r}{modules.get(name, '')}{reasons.get(name, '')}"
                 for op, name in unconverted[:MAX_LISTED]]
        if len(unconverted) > MAX_LISTED:
            lines.append(f"  and {len(unconverted) - MAX_LISTED} more (result.float_nodes lists them all)")
        kinds = ", ".join(f"{op} x{n}" for op, n in Counter(op for op, _ in unconverted).most_common())
        warnings.warn(f"left in float between DequantizeLinear and QuantizeLinear, {len(unconverted)} nodes "
                      f"({kinds}):\n" + "\n".join(lines), UnconvertedOpsWarning, stacklevel=3)
    if findings.heads_kept:
        kept = list(findings.heads_kept.items())[:MAX_LISTED]
        listed = [f"  {name!r}{modules.get(name, '')}: {why}" for name, why in kept]
        n = len(findings.heads_kept)
        warnings.warn(f"{n} attention{'s keep' if n > 1 else ' keeps'} heads that look pruned (result.heads_kept):\n"
                      + "\n".join(listed) + "\nthin the model in PyTorch before export (recal_torch.thin), which "
                      "follows it by running it", ThinningWarning, stacklevel=3)
    twin = avx2_twin(model) if choice.twin and saturating else None
    if twin is not None:
        mark(model, INT8_CPUS)
    twin_name = twin_path(output_path).name if twin is not None and output_path is not None else "result.avx2_model"
    result = ConversionResult(model, None, rewrites, unconverted, float_ops=float_compute(model, format == "qdq"),
                              weight_type="uint8" if rewrites.get("uint8_weights") else "int8", target=choice.target,
                              weights_note=_weights_note(choice, saturating, rewrites.get("uint8_weights", 0),
                                                         twin_name if twin is not None else None),
                              rounded_biases=dict(findings.rounded_biases), float_reasons=why,
                              coarse_biases=dict(findings.coarse_biases), heads_kept=dict(findings.heads_kept),
                              masked_scores=dict(findings.masked_scores), grid_weights=dict(findings.grid_weights),
                              notes=list(findings.notes))
    for note in (result.masked_scores_note, result.grid_weights_note, *result.notes):
        if note:
            log.info("quantize_qat_export: %s", note)
    if result.float_ops:
        log.info("quantize_qat_export: computing in float (outside quantized tensors, by design, or listed above): "
                 "%s", ", ".join(f"{op} x{n}" for op, n in result.float_ops.items()))
    result.avx2_model = twin
    if verify:
        exact_here = cpu.int8_weights_exact_here()
        run_here = twin if twin is not None and not exact_here else exact_on_this_cpu(model)
        if run_here is twin:
            result.weights_note += ("; verified as the twin for x86 without VNNI (this CPU's kind), whose integers are "
                                    "the int8 model's")
        elif run_here is not model:
            result.weights_note += ("; verified as its target computes it (this CPU has no VNNI and would saturate "
                                    "its int8 weights beyond +-64: run it on the target)")
        try:
            result.verification = verify_models(reference, run_here, inputs, thinned=findings.thinned,
                                                output_steps=output_steps, noise=tolerance is None,
                                                tied=findings.tied_pools, moves=findings.bias_moves)
        except NonFiniteReferenceError as exc:
            raise ModelError(f"{exc}: the QAT model itself computes nothing finite"
                             f"{nonfinite_initializers(reference)}; nothing was written") from None
        problem = result.verification.problem(tolerance, min_agreement)
        if problem:
            hint = f" ({result.rounded_biases_note})" if result.rounded_biases else ""
            own_data = "" if given else ("; these were generated inputs (normal noise, open dimensions as said in "
                                         "recal_onnx.verify_inputs): judge it on your own data with --inputs "
                                         "FILE.npz (inputs= in the API)")
            raise VerificationError(f"the converted model does not match the input model: {problem}{hint}; "
                                    f"nothing was written{_drift_note(result.verification, tolerance, min_agreement)}"
                                    f"{own_data}")
        if twin is not None and run_here is model:
            differs = twin_differs(model, twin, inputs if inputs is not None else generated_inputs(model, TWIN_SAMPLES))
            if differs:
                raise VerificationError(f"the uint8-weight twin for x86 without VNNI differs from the verified int8 "
                                        f"model on output {differs!r}; nothing was written")
        if result.verification.compared_nothing:
            warnings.warn("the verification compared nothing end to end: every output is constant over its inputs "
                          f"({result.verification}); give inputs= that make the outputs vary", UserWarning,
                          stacklevel=3)
        why = "as close to the input model as onnxruntime's own session of it" if result.verification.within_runtime \
            else "within the QAT model's own rounding noise" if result.verification.within_noise else None
        if why:
            log.warning("quantize_qat_export: accepted beyond the default end-to-end tolerance, %s: %s", why,
                        result.verification)
    if output_path is not None:  # the pair in one transaction: both written, then both moved in; else neither
        result.path, result.avx2_path = save_models_atomically(model, output_path, twin)
        stale = twin_path(output_path)
        if twin is None and stale.exists():  # an earlier conversion's twin beside a model it no longer matches
            warnings.warn(f"{stale} is not the twin of the model just written ({result.weights_note}): it is left "
                          "from an earlier conversion to this path; remove it", UserWarning, stacklevel=2)
    result.seconds = time.perf_counter() - started
    log.debug("quantize_qat_export: %s in %.2fs", {k: v for k, v in rewrites.items() if v}, result.seconds)
    return result


def _drift_note(v, tolerance: float | None, min_agreement: float | None) -> str:
    """When only the end-to-end difference fails (every integer op within a step of the QAT model's own, op by op),
    what was measured and how to accept it: one-step roundings add up across a deep model's layers."""
    if tolerance is not None or v.local_steps is None or v.problem(math.inf, min_agreement) is not None:
        return ""
    return (f". Op by op every integer tensor is within {v.local_steps} step(s) of the QAT model's, so the "
            f"difference built up across layers ({v}); if that agreement is enough for this model, accept it with "
            f"tolerance={v.max_abs_diff * 1.01:.4g} (recal quantize-qat-export --tolerance)")


def _weights_note(choice: WeightChoice, saturating: int, shifted: int, twin: str | None = None) -> str:
    """One sentence: which weight form was written and why (which file for which CPU, with a twin)."""
    if not saturating:
        return (f"one file: every int8 weight (if any) within +-64, none saturates, exact and fast on every CPU "
                f"(target {choice.target})")
    if twin is not None:
        return (f"int8 weights, {saturating} layers beyond +-64: this model is exact and fast on x86 with VNNI or AMX "
                f"and on Arm; on x86 without VNNI (AVX2) run {twin}, the same model with those layers' weights uint8, "
                "exact there (target any; 7-bit weights, as recal's reduce_range: true trains them, make one file "
                "exact and fast everywhere)")
    if shifted:
        return f"uint8 weights in {shifted} layers ({choice.why})"
    return f"int8 weights, {saturating} layers beyond +-64 ({choice.why}; they saturate on x86 without VNNI)"




def _output_quanta(g: Graph) -> dict[str, float]:
    """Each graph output that a DequantizeLinear writes: its (largest) quantization step, by output name."""
    steps = {}
    for value in g.graph.outputs:
        node = g.producer(value)
        if node is not None and node.op_type == "DequantizeLinear" and g.is_const(node.inputs[1]):
            steps[value.name] = float(np.max(g.const(node.inputs[1])))
    return steps
