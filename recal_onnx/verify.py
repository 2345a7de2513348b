"""Run two ONNX models in onnxruntime (default session options) on the same inputs and compare them.

Two comparisons, both enforced. End to end: every graph output, in its own units (:class:`OutputDiff`): an
integer output (a QuantizeLinear's, say) in its integer steps, class ids (an ArgMax's) by agreement, a float
output within a share of its range (or in its quantization steps when a DequantizeLinear writes it). Op by op:
the converted model's every integer tensor that the QAT model quantizes too (a QuantizeLinear's output, by
name), each computed from the QAT model's own values of the integer tensors it reads, so a rounding difference
upstream does not travel: a correct conversion differs there by at most one step (a value on a rounding boundary),
whatever the model. The op-by-op check adds to the end-to-end one and never replaces it.

A deep trained model can pass op by op and still differ end to end by more than the default tolerance: the few
values on a rounding boundary at each layer flip, and later layers carry the flips on. The QAT model's own float
evaluation is no more certain than that: moving each activation quantizer's input by 8 float32 ulps (2**-20 of
it, a float sum's rounding error over a few dozen terms; another kernel's summation order does as much) moves its
outputs as far (``scripts/bench_keras_applications.py`` sets the int8 difference of trained keras.applications
models beside Keras's own float run of the same QAT model). So where the op-by-op check is clean, the end-to-end
default also accepts what that nudge of the QAT model itself produces (:func:`rounding_noise`), and says so.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

import numpy as np
import onnx

from .output_diff import (CLASS_AGREEMENT, CLASS_ID_OPS, FLOAT_ONLY_SHARE, FLOAT_SHARE,  # noqa: F401 (re-exported)
                          STEPS, OutputDiff, OutputStats, float_gap)
from .input_checks import ModelError
from .qdq import signedness_shift
from .verify_inputs import batched_inputs, fixed_batch, generated_inputs, integer_ranges  # noqa: F401 (re-exported)



LOCAL_STEPS = 1  # op by op: an integer tensor may differ by one step (a value on a rounding boundary)
LOCAL_FLOAT = 0.001  # op by op: a float output within 0.1% of its range (the ops after the last integer tensor)
LOCAL_SHARE = 1e-3  # op by op: at most this share of the compared integer values may differ (by that one step)
LOCAL_SAMPLES = 16  # the op-by-op check runs on the first samples
NUDGE = 2.0 ** -20  # rounding_noise: the relative move of each activation quantizer's input (8 float32 ulps)
NOISE_PATTERNS = 3  # ... and its seeded draws (each quantizer up or down)
CHUNK = 16  # samples per onnxruntime run in the end-to-end comparison
LOCAL_MAX_BYTES = 1_500_000_000  # above this a model is not copied for the op-by-op check (protobuf's 2 GB)


@dataclass
class Verification:
    max_abs_diff: float
    output_range: float
    argmax_agreement: float | None  # for 2-D outputs
    samples: int
    output_step: float = 0.0  # the quantization step of a quantized output (0: the output is float)
    local_steps: int | None = None  # op by op: the largest difference of an integer tensor, in steps
    local_tensor: str = ""  # ... and which tensor
    local_float: float | None = None  # op by op: the largest float-output difference, share of its range
    local_tensors: int = 0  # integer tensors compared op by op
    local_share: float | None = None  # op by op: the share of their values that differ
    local_share_tensor: str = ""  # ... and the tensor with the most differing values
    local_tied: int = 0  # integer pools whose exact ties were counted apart, up to their tie share (``tied``)
    median_abs_diff: float = 0.0  # end to end, of every output value
    outputs: tuple[OutputDiff, ...] = ()  # end to end, each graph output in its own units

    @property
    def compared_nothing(self) -> bool:
        """Every float or integer output was constant over the inputs: the end-to-end check saw no variation."""
        ranged = [o for o in self.outputs if o.kind in ("float", "integer")]
        return bool(ranged) and all(o.output_range == 0 for o in ranged)

    @property
    def max_steps(self) -> float | None:
        """The largest difference in output quantization steps (None for a float output)."""
        return self.max_abs_diff / self.output_step if self.output_step > 0 else None

    @property
    def clean_op_by_op(self) -> bool:
        """Every compared integer tensor within a step, few values on a boundary, float outputs within 0.1%."""
        return (self.local_steps is not None and self.local_steps <= LOCAL_STEPS
                and self.local_share is not None and self.local_share <= LOCAL_SHARE
                and (self.local_float is None or self.local_float <= LOCAL_FLOAT))

    @property
    def within_noise(self) -> bool:
        """Accepted end to end only because the QAT model's own rounding noise is as large (see the module)."""
        return any(o.noise is not None and o.problem(None, None) is None
                   and replace(o, noise=None).problem(None, None) is not None for o in self.outputs)

    def problem(self, tolerance: float | None, min_agreement: float | None = None) -> str | None:
        """Why the candidate fails, or None. Op by op: every compared integer tensor within one step, float outputs
        within 0.1% of their range. End to end, always, every output in its own units (:class:`OutputDiff`):
        ``tolerance`` (a max abs difference) when given; without it 3 steps of a quantized or integer output, 10%
        of a float output's range, or the QAT model's own rounding noise where it is larger and the op-by-op check
        is clean (:func:`rounding_noise`); class ids agreeing on ``min_agreement`` (default 0.95).

        Args:
            tolerance: the largest max-abs difference accepted end to end, or None for the per-unit defaults.
            min_agreement: the least class-id agreement accepted for ArgMax-like outputs, or None for 0.95."""
        parts = []
        if self.local_steps is not None and self.local_steps > LOCAL_STEPS:
            parts.append(f"op by op, tensor {self.local_tensor!r} differs by {self.local_steps} quantization steps "
                         f"from the QAT model's (computed from the QAT model's own inputs; at most {LOCAL_STEPS})")
        if self.local_share is not None and self.local_share > LOCAL_SHARE:
            parts.append(f"op by op, {100 * self.local_share:.3g}% of the integer values differ from the QAT model's "
                         f"(at most {100 * LOCAL_SHARE:g}%: values on a rounding boundary), most in tensor "
                         f"{self.local_share_tensor!r}")
        if self.local_float is not None and not self.local_float <= LOCAL_FLOAT:
            parts.append(f"op by op, a float output differs by {100 * self.local_float:.2f}% of its range "
                         f"(at most {100 * LOCAL_FLOAT:g}%)")
        parts += [p for p in (o.problem(tolerance, min_agreement) for o in self.outputs) if p]
        if not self.outputs and (tolerance is not None and not self.max_abs_diff <= tolerance):
            parts.append(f"max abs difference {self.max_abs_diff:.4g} > {tolerance:.4g}")
        if min_agreement is not None and self.argmax_agreement is not None \
                and self.argmax_agreement < min_agreement:
            parts.append(f"argmax agreement {self.argmax_agreement:.4f} < {min_agreement}")
        return "; ".join(parts) or None

    def __str__(self) -> str:
        agree = "" if self.argmax_agreement is None else f", argmax agreement {self.argmax_agreement:.4f}"
        steps = "" if self.max_steps is None else f", {self.max_steps:.2f} output steps"
        local = "" if self.local_steps is None else (
            f"; op by op: {self.local_tensors} integer tensors within {self.local_steps} step(s)"
            + ("" if self.local_share is None else f" ({self.local_share:.2g} of their values differ)")
            + ("" if self.local_float is None else f", float outputs within {100 * self.local_float:.3f}% of range")
            + (f"; {self.local_tied} average pools' exact ties (which the QAT model's float noise decides) counted "
               "apart, up to the share of values that can tie" if self.local_tied else ""))
        noise = [o for o in self.outputs if o.noise is not None]
        if noise:
            local += ("; the QAT model's own rounding noise (its outputs when each activation quantizer's input moves "
                      "by 8 float32 ulps): " + ", ".join(o._in_steps(o.noise) for o in noise)
                      + (", within which the difference is accepted" if self.within_noise else ""))
        return (f"max abs diff {self.max_abs_diff:.4g} (median {self.median_abs_diff:.3g}, output range "
                f"{self.output_range:.4g}{steps}){agree} on "
                f"{self.samples} samples{local}")


def session(model: onnx.ModelProto | str, threads: int | None = None, level=None, order=None):
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3  # its warnings on the files compared (an initializer also an input...): noise here
    if level is not None:
        options.graph_optimization_level = level
    if order is not None:
        options.execution_order = order
    if threads:
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
    source = model if isinstance(model, str) else model.SerializeToString()
    return ort.InferenceSession(source, options, providers=["CPUExecutionProvider"])


def reference_session(model: onnx.ModelProto | str):
    """A session that runs an input QDQ model as written, in float (optimizations disabled).

    That is the model's meaning. At its default level onnxruntime fuses QDQ into integer kernels,
    whose x86 u8s8 variants saturate on CPUs without VNNI (AVX2, AVX-512F): a reference that is
    itself off by whole output steps there.

    Its ops run in priority order: by default onnxruntime starts with every op that reads only initializers, so
    a weight-only decoder dequantized all its weights to float before its first layer (2.4 GB at once for a 0.6 B
    model); in priority order each weight is dequantized near its use (1.1 GB).
    """
    import onnxruntime as ort

    return session(model, level=ort.GraphOptimizationLevel.ORT_DISABLE_ALL, order=ort.ExecutionOrder.PRIORITY_BASED)


class NonFiniteReference(ValueError):
    """The model being verified against gives no finite value on some output: a defect of that model, not of a
    conversion (nothing can be compared with it)."""

    def __init__(self, outputs: list[str]):
        self.outputs = outputs
        super().__init__(f"the input model's output(s) {', '.join(map(repr, outputs))} are NaN or infinite on every "
                         "verification input")


def verify_models(reference: onnx.ModelProto | str, candidate: onnx.ModelProto,
                  inputs: dict[str, np.ndarray] | None = None, output_step: float = 0.0,
                  thinned: dict[str, np.ndarray] | None = None,
                  output_steps: dict[str, float] | None = None, noise: bool = True,
                  tied: dict[str, float] | None = None) -> Verification:
    """Compare ``candidate`` with ``reference`` in onnxruntime, end to end and op by op.

    Args:
        reference: the model the candidate was made from (a model or a path), run as written.
        candidate: the converted model.
        inputs: the inputs by name (generated when None: integer inputs cover the table they index, masks are ones).
        output_step: the float outputs' quantization step, when a DequantizeLinear writes them (0: float outputs).
        thinned: per tensor name, the channels (axis 1) the candidate kept of a tensor whose dead channels it
            removed.
        output_steps: per output name, its quantization step (overrides ``output_step`` for that output).
        noise: where only the end-to-end default fails and the op-by-op check is clean, measure the QAT model's own
            rounding noise (:func:`rounding_noise`), which the default then accepts.
        tied: integer pool outputs whose exact ties the candidate rounds otherwise than the QAT model's float noise
            does, each with the share of its values that can tie (``Findings.tied_pools``): held to one step op by
            op, up to that share of their values differing counted apart."""
    feeds = inputs if inputs is not None else generated_inputs(candidate)
    batched, fixed = batched_inputs(candidate), fixed_batch(candidate)
    producers = {o: n.op_type for n in candidate.graph.node for o in n.output}
    names = [o.name for o in candidate.graph.output]
    steps = output_steps or {}
    stats = [OutputStats() for _ in names]
    runners = reference_session(reference), session(candidate)  # the converted model must load with defaults
    samples, per_sample = 0, 0
    for ref, got in _paired_chunks(runners, feeds, batched, fixed):
        samples += int(ref[0].shape[0]) if ref and ref[0].ndim else 1
        per_sample = max(per_sample, sum(r.nbytes + g.nbytes for r, g in zip(ref, got)) // max(
            int(ref[0].shape[0]) if ref and ref[0].ndim else 1, 1))
        for stat, r, g in zip(stats, ref, got):
            stat.add(r, g)
    del runners  # their memory (a float reference's dequantized weights) before the op-by-op sessions are made
    dead = [name for s, name in zip(stats, names) if s.count and s.nonfinite == s.count]
    if dead:
        raise NonFiniteReference(dead)
    copy = _copyable(reference)  # loaded once for the checks below (None: too large to copy; end to end only)
    share = FLOAT_ONLY_SHARE if copy is not None and float_only(copy, candidate) else FLOAT_SHARE
    outputs = tuple(s.diff(name, producers.get(name, ""), steps.get(name, output_step), share)
                    for s, name in zip(stats, names))
    diff = max((o.max_abs_diff for o in outputs if o.kind != "class ids"), default=0.0)
    span = max((o.output_range for o in outputs if o.kind != "class ids"), default=0.0)
    first = stats[0] if stats else OutputStats()
    agreement = first.argmax_agree / first.argmax_rows if first.argmax_rows else None
    sample = np.concatenate([s.sample() for s in stats]) if stats else np.zeros(0)
    median = float(np.median(sample)) if sample.size else 0.0
    first_step = next((o.step for o in outputs if o.kind == "float"), output_step)
    result = Verification(diff, span, agreement, samples, first_step, median_abs_diff=median, outputs=outputs)
    if copy is None:
        return result
    result = op_by_op(copy, candidate, feeds, result, thinned or {}, per_sample, tied or {})
    failing = [o for o in result.outputs if o.problem(None, None)]
    if noise and result.clean_op_by_op and failing and all(o.kind not in ("class ids", "bool") for o in failing):
        own = rounding_noise(copy, feeds, batched, fixed=fixed)
        ranged = ("float", "integer")
        result = replace(result, outputs=tuple(replace(o, noise=own.get(o.name)) if o.kind in ranged else o
                                               for o in result.outputs))
    return result


def float_only(reference: onnx.ModelProto, candidate: onnx.ModelProto) -> bool:
    """Neither model quantizes an activation: every QuantizeLinear of the reference reads a constant (weight-only
    layers, dequantized in float) and the candidate computes in float (no ``MatMulNBits`` told to quantize its input,
    ``accuracy_level`` > 0). Both are then the same float arithmetic, compared at float precision
    (:data:`FLOAT_ONLY_SHARE` of a float output's range), not at the share integer rounding needs."""
    graph = reference.graph
    constant = {i.name for i in graph.initializer} | {o for n in graph.node if n.op_type == "Constant"
                                                      for o in n.output}
    if any(n.op_type == "QuantizeLinear" and n.input[0] not in constant for n in graph.node):
        return False
    approximate = any(n.op_type == "MatMulNBits" and any(a.name == "accuracy_level" and a.i > 0 for a in n.attribute)
                      for n in candidate.graph.node)
    integer = any(n.op_type in ("QLinearConv", "QLinearMatMul", "QGemm", "MatMulInteger", "ConvInteger",
                                "DynamicQuantizeLinear", "MatMulIntegerToFloat", "QuantizeLinear")
                  for n in candidate.graph.node)
    return not approximate and not integer


def rounding_noise(reference: onnx.ModelProto | str, feeds: dict[str, np.ndarray], batched: set[str],
                   patterns: int = NOISE_PATTERNS, fixed: int | None = None) -> dict[str, float]:
    """Per float or integer output, how far the QAT model's own outputs move when the input of each activation
    quantizer (a QuantizeLinear that reads a computed tensor, not a weight) moves by :data:`NUDGE` of itself, up or
    down (random per quantizer, ``patterns`` seeded draws): the most, over the draws, of the max abs difference.

    The QAT model's meaning is float arithmetic, whose summation order is the kernel's choice: another order moves a
    conv's output by about that much, and a value on a rounding boundary then lands one step over. An int8 model is
    exact where the float one is not, so it can be this far from it with every op right."""
    reference = _copyable(reference)
    if reference is None:
        return {}
    names = [o.name for o in reference.graph.output]
    worst: dict[str, float] = {}
    runners = (reference_session(reference), *(reference_session(_nudged(reference, s)) for s in range(patterns)))
    for plain, *nudged in _paired_chunks(runners, feeds, batched, fixed):  # the plain model once for every draw
        for got in nudged:
            for name, r, g in zip(names, plain, got):
                if r.shape == g.shape and r.size and (np.issubdtype(r.dtype, np.floating) or r.dtype.itemsize < 4):
                    diff = float(np.abs(r.astype(np.float64) - g.astype(np.float64)).max())
                    worst[name] = max(worst.get(name, 0.0), diff)
    return worst


def _copyable(reference: onnx.ModelProto | str) -> onnx.ModelProto | None:
    """``reference`` as a model the checks beyond end to end may copy, or None above :data:`LOCAL_MAX_BYTES`."""
    size = os.path.getsize(reference) if isinstance(reference, str) else reference.ByteSize()
    if size > LOCAL_MAX_BYTES:
        return None
    return onnx.load(reference) if isinstance(reference, str) else reference


def _nudged(model: onnx.ModelProto, seed: int) -> onnx.ModelProto:
    """``model`` with each activation quantizer's input multiplied by ``1 + NUDGE`` or ``1 - NUDGE``."""
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    graph = copy.graph
    constant = {i.name for i in graph.initializer} | {o for n in graph.node if n.op_type == "Constant"
                                                      for o in n.output}
    float32 = {i.name for i in graph.initializer if i.data_type == onnx.TensorProto.FLOAT} | {  # a scale: x's type
        n.output[0] for n in graph.node if n.op_type == "Constant" and n.attribute
        and n.attribute[0].type == onnx.AttributeProto.TENSOR and n.attribute[0].t.data_type == onnx.TensorProto.FLOAT}
    rng = np.random.default_rng(seed)
    up, down = np.float32(1 + NUDGE), np.float32(1 - NUDGE)  # both exact in float32
    nodes = []
    for i, node in enumerate(graph.node):
        if node.op_type == "QuantizeLinear" and node.input[0] not in constant and node.input[1] in float32:
            factor, moved = f"__recal_nudge_{i}", f"__recal_nudged_{i}"
            graph.initializer.append(onnx.numpy_helper.from_array(np.array(up if rng.integers(2) else down), factor))
            nodes.append(onnx.helper.make_node("Mul", [node.input[0], factor], [moved]))
            node.input[0] = moved
        nodes.append(node)
    del graph.node[:]
    graph.node.extend(nodes)
    return copy


MEMORY = 256 * 2**20  # bytes of both models' outputs held at once in the end-to-end comparison
def _paired_chunks(runners, feeds: dict[str, np.ndarray], batched: set[str], fixed: int | None = None):
    """Both models' outputs on the same samples, a chunk at a time: the first sample alone (to measure what one
    costs), then as many as fit :data:`MEMORY` (at most :data:`CHUNK`), so memory stays bounded whatever the
    output size (a language model's logits over its vocabulary). A ``fixed`` batch runs one batch at a time
    (feeds of several batches stacked); one run where an output does not follow the batch."""
    sizes = {np.shape(v)[0] if np.ndim(v) else -1 for v in feeds.values()}
    total = next(iter(sizes)) if len(sizes) == 1 else -1
    if fixed and feeds and total > fixed and total % fixed == 0 and not set(feeds) & batched:
        yield from _fixed_chunks(runners, feeds, fixed, total)
        return
    if not feeds or set(feeds) - batched or total <= 1:
        yield tuple(r.run(None, feeds) for r in runners)
        return
    start, size = 0, 1
    while start < total:
        part = {k: v[start:start + size] for k, v in feeds.items()}
        outs = tuple(r.run(None, part) for r in runners)
        rows = min(size, total - start)
        if any(np.ndim(o) == 0 or np.shape(o)[0] != rows for out in outs for o in out):
            if start:
                raise ValueError("a model's outputs follow the batch for some samples and not others")
            yield tuple(r.run(None, feeds) for r in runners)
            return
        yield outs
        if start == 0:
            per_sample = max(sum(o.nbytes for out in outs for o in out), 1)
            size = int(max(1, min(CHUNK, MEMORY // per_sample)))
        start += rows


def _fixed_chunks(runners, feeds: dict[str, np.ndarray], fixed: int, total: int):
    """:func:`_paired_chunks` for a model whose batch is fixed: ``total / fixed`` runs of one batch each; only the
    first where an output does not follow the batch (it would be counted once per run)."""
    for start in range(0, total, fixed):
        outs = tuple(r.run(None, {k: v[start:start + fixed] for k, v in feeds.items()}) for r in runners)
        yield outs
        if start == 0 and any(np.ndim(o) == 0 or np.shape(o)[0] != fixed for out in outs for o in out):
            return


def fixed_parts(feeds: dict[str, np.ndarray], fixed: int | None) -> list[dict[str, np.ndarray]] | None:
    """``feeds`` as one feed a batch where the model's ``fixed`` batch splits them into several, else None (one
    run takes them all)."""
    total = {np.shape(v)[0] if np.ndim(v) else -1 for v in feeds.values()}
    if not fixed or len(total) != 1 or (n := total.pop()) <= fixed or n % fixed:
        return None
    return [{k: v[s:s + fixed] for k, v in feeds.items()} for s in range(0, n, fixed)]


def run_batches(sess, feeds: dict[str, np.ndarray], fixed: int | None) -> list[np.ndarray]:
    """``sess`` on ``feeds``, one fixed batch at a time where ``fixed`` splits them, outputs concatenated."""
    split = fixed_parts(feeds, fixed)
    if split is None:
        return sess.run(None, feeds)
    parts = [sess.run(None, part) for part in split]
    if any(np.ndim(o) == 0 or np.shape(o)[0] != fixed for o in parts[0]):
        return parts[0]  # an output that does not follow the batch: the first batch's alone
    return [np.concatenate(outs) for outs in zip(*parts)]


def _with_outputs(model: onnx.ModelProto, names: list[str]) -> onnx.ModelProto:
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    present = {o.name for o in copy.graph.output}
    copy.graph.output.extend(onnx.helper.make_empty_tensor_value_info(n) for n in names if n not in present)
    return copy


def op_by_op(reference: onnx.ModelProto | str, candidate: onnx.ModelProto, feeds: dict[str, np.ndarray],
             result: Verification, thinned: dict[str, np.ndarray], per_sample: int = 0,
             tied: dict[str, float] | None = None) -> Verification:
    """``result`` with the op-by-op comparison filled in (unchanged where a model is too large to copy).
    ``per_sample``: the bytes one sample's outputs took end to end; the op-by-op run takes as many samples as
    fit :data:`MEMORY` (at most :data:`LOCAL_SAMPLES`)."""
    reference = _copyable(reference)
    if reference is None or candidate.ByteSize() > LOCAL_MAX_BYTES:
        return result
    batched, fixed = batched_inputs(candidate), fixed_batch(candidate)
    local = int(max(1, min(LOCAL_SAMPLES, MEMORY // max(per_sample, 1))))
    if fixed:  # whole fixed batches, as many as make ``local`` samples (at least one)
        local = max(local // fixed, 1) * fixed
        feeds = {k: v[:local] for k, v in feeds.items()}
    else:
        feeds = {k: v[:local] if k in batched else v for k, v in feeds.items()}
    produced = {o for n in candidate.graph.node for o in n.output} - {o.name for o in candidate.graph.output}
    names = [n.output[0] for n in reference.graph.node if n.op_type == "QuantizeLinear" and n.output[0] in produced]
    if not names:  # no quantized activation both models compute (a weight-only model): end to end says it all
        return result
    outputs = len(candidate.graph.output)
    reference_run = reference_session(_with_outputs(reference, names))
    probe = _with_outputs(candidate, names)  # its own values first (their types and shapes), then forced
    own_run, forced_run, given_names = session(probe), None, []
    steps, counts, compared, pairs = {}, {}, 0, []  # pairs: each run's float outputs, (candidate, QAT model)
    for part in fixed_parts(feeds, fixed) or [feeds]:  # one fixed batch a run, each with its own QAT integers
        ref_values = reference_run.run(None, part)
        ref_outputs, ref = ref_values[:outputs], dict(zip(names, ref_values[outputs:]))
        for name, kept in thinned.items():
            if name in ref and ref[name].ndim > 1 and ref[name].shape[1] > kept.max(initial=-1):
                ref[name] = np.take(ref[name], kept, axis=1)
        own = dict(zip(names, own_run.run(None, part)[outputs:]))
        if forced_run is None:  # the tensors both models hold on one grid, and the probe that reads the QAT's
            given_names = [name for name in names if _on_grid(own[name], ref[name]) is not None]
            if not given_names:
                return result
            forced = _with_outputs(candidate, names)
            for node in forced.graph.node:
                for i, name in enumerate(node.input):
                    if name in given_names:
                        node.input[i] = name + "__qat"
            forced.graph.input.extend(onnx.helper.make_tensor_value_info(
                name + "__qat", onnx.helper.np_dtype_to_tensor_dtype(own[name].dtype), None) for name in given_names)
            forced_run = session(forced)
        on_grid = {name: _on_grid(own[name], ref[name]) for name in given_names}
        given = {name: value for name, value in on_grid.items() if value is not None}  # the rest: its own values
        got = forced_run.run(None, {**part, **{name + "__qat": given.get(name, own[name]) for name in given_names}})
        for name, value in zip(names, got[outputs:]):
            if name in given:
                diff = np.abs(value.astype(np.int32) - given[name].astype(np.int32))
                steps[name] = max(steps.get(name, 0), int(diff.max(initial=0)))
                apart = int((tied or {}).get(name, 0.0) * diff.size)  # exact ties, at most as many as can be
                counts[name] = counts.get(name, 0) + max(int(np.count_nonzero(diff)) - apart, 0)
                compared += diff.size
        pairs.append([(g, r) for g, r in zip(got, ref_outputs) if np.issubdtype(r.dtype, np.floating) and r.size])
    floats = [float_gap(np.concatenate([run[i][0].reshape(-1) for run in pairs]),
                        np.concatenate([run[i][1].reshape(-1) for run in pairs])) for i in range(len(pairs[0]))]
    where = max(steps, key=steps.get)
    return replace(result, local_steps=steps[where], local_tensor=where, local_float=max(floats) if floats else None,
                   local_tensors=len(given_names), local_share=sum(counts.values()) / max(compared, 1),
                   local_share_tensor=max(counts, key=counts.get),
                   local_tied=len(set(tied or {}) & set(given_names)))


def _on_grid(mine: np.ndarray, theirs: np.ndarray) -> np.ndarray | None:
    """The QAT model's integers ``theirs`` on the candidate's grid, typed as ``mine`` (int8 activations that became
    uint8: +128); None where ``mine`` is no 8-bit tensor or the values leave its type (another grid)."""
    if mine.dtype not in (np.uint8, np.int8) or mine.shape != theirs.shape:
        return None
    value = np.asarray(theirs.astype(np.int16) + signedness_shift(theirs.dtype, mine.dtype))  # (a 0-d tensor stays an array, as onnxruntime takes)
    if value.size and (value.min() < np.iinfo(mine.dtype).min or value.max() > np.iinfo(mine.dtype).max):
        return None
    return np.asarray(value.astype(mine.dtype))


def runtime_refusal(reference: onnx.ModelProto | str) -> str | None:
    """onnxruntime's reason for refusing the input model as written, loaded and run on one generated sample, or None
    when it runs (or cannot be tried)."""
    try:
        model = onnx.load(reference, load_external_data=False) if isinstance(reference, str) else reference
        feeds = generated_inputs(model, 1)
        reference_session(reference).run(None, feeds)
    except (MemoryError, ModelError):
        return None
    except Exception as exc:  # noqa: BLE001 - its message is the answer
        return " ".join(str(exc).split())[:500]
    return None
