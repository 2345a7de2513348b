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

from dataclasses import dataclass, replace

import numpy as np
import onnx

from .output_diff import (CLASS_AGREEMENT, CLASS_ID_OPS, FLOAT_ONLY_SHARE, FLOAT_SHARE,  # noqa: F401 (re-exported)
                          STEPS, OutputDiff, OutputStats, float_gap)
from .errors import ModelError, NonFiniteReferenceError
from .verify_inputs import batched_inputs, fixed_batch, generated_inputs, integer_ranges  # noqa: F401 (re-exported)
from .op_by_op import (BOUNDARY, LOCAL_MAX_BYTES, LOCAL_SAMPLES, MEMORY, _copyable, _on_grid,  # noqa: F401
                       _with_outputs, fixed_parts, op_by_op)
from .verify_budget import check_tensor_sizes
from .sessions import Tolerant, reference_session, runtime_session, session  # re-exported



LOCAL_STEPS = 1  # op by op: an integer tensor may differ by one step (a value on a rounding boundary)
LOCAL_FLOAT = 0.001  # op by op: a float output within 0.1% of its range (the ops after the last integer tensor)
LOCAL_SHARE = 1e-3  # op by op: beyond this share of differing values, each difference must be explained (below)
NUDGE = 2.0 ** -20  # rounding_noise: the relative move of each activation quantizer's input (8 float32 ulps)
NOISE_PATTERNS = 3  # ... and its seeded draws (each quantizer up or down)
CHUNK = 16  # samples per onnxruntime run in the end-to-end comparison


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
    local_unexplained: int = 0  # op by op: differing values whose QAT value was not within BOUNDARY of a boundary
    local_margin: float | None = None  # ... the largest distance from the boundary among the differing values (steps)
    local_margin_tensor: str = ""  # ... and its tensor
    runtime_refused: str = ""  # onnxruntime's reason for not loading the input in a default session, if it did not
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
    def _within_a_step(self) -> bool:
        """Op by op ran: every compared integer tensor within one step, float outputs within 0.1%."""
        return (self.local_steps is not None and self.local_steps <= LOCAL_STEPS
                and (self.local_float is None or self.local_float <= LOCAL_FLOAT))

    @property
    def explained(self) -> bool:
        """Op by op, every integer that differs is one step off with the QAT model's own value on the boundary
        between the two (rounding; no misread weight, scale or sign), float outputs within 0.1%."""
        return self._within_a_step and not self.local_unexplained

    @property
    def clean_op_by_op(self) -> bool:
        """What the op-by-op check accepts: every difference explained, or few enough to be values on a boundary."""
        return self.explained or (self._within_a_step and self.local_share is not None
                                  and self.local_share <= LOCAL_SHARE)

    @property
    def within_runtime(self) -> bool:
        """Accepted end to end only because onnxruntime's own session of the input is as far from it."""
        return any(o.runtime is not None and o.problem(None, None) is None
                   and replace(o, runtime=None).problem(None, None) is not None for o in self.outputs)

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
        if self.local_share is not None and self.local_share > LOCAL_SHARE and self.local_unexplained:
            parts.append(f"op by op, {100 * self.local_share:.3g}% of the integer values differ from the QAT model's "
                         f"(most in tensor {self.local_share_tensor!r}), and {self.local_unexplained} of them are not "
                         f"values on a rounding boundary: the QAT model's own unrounded value lay up to "
                         f"{self.local_margin:.3g} step(s) from the boundary between the two integers in tensor "
                         f"{self.local_margin_tensor!r} (rounding explains {BOUNDARY:g}, and what a rounded bias "
                         "moves): a misread weight, scale or sign, not rounding")
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
            + ("" if self.local_share is None else f" ({self.local_share:.2g} of their values differ"
               + ("" if self.local_margin is None else
                  f", each within {self.local_margin:.2g} step of a rounding boundary of the QAT model's value"
                  if not self.local_unexplained else f", {self.local_unexplained} not on a rounding boundary") + ")")
            + ("" if self.local_float is None else f", float outputs within {100 * self.local_float:.3f}% of range")
            + (f"; {self.local_tied} average pools' exact ties (which the QAT model's float noise decides) counted "
               "apart, up to the share of values that can tie" if self.local_tied else ""))
        noise = [o for o in self.outputs if o.noise is not None]
        if noise:
            local += ("; the QAT model's own rounding noise (its outputs when each activation quantizer's input moves "
                      "by 8 float32 ulps): " + ", ".join(o._in_steps(o.noise) for o in noise)
                      + (", within which the difference is accepted" if self.within_noise else ""))
        typical = [o.typical_note() for o in self.outputs if o.typical is not None and o.runtime is not None]
        if self.runtime_refused:
            local += f"; onnxruntime's default session cannot run the input ({self.runtime_refused})"
        if typical:
            local += "; " + "; ".join(typical) + (
                ", within which the difference is accepted" if self.within_runtime else "")
        return (f"max abs diff {self.max_abs_diff:.4g} (median {self.median_abs_diff:.3g}, output range "
                f"{self.output_range:.4g}{steps}){agree} on "
                f"{self.samples} samples{local}")


def verify_models(reference: onnx.ModelProto | str, candidate: onnx.ModelProto,
                  inputs: dict[str, np.ndarray] | None = None, output_step: float = 0.0,
                  thinned: dict[str, np.ndarray] | None = None,
                  output_steps: dict[str, float] | None = None, noise: bool = True,
                  tied: dict[str, float] | None = None, runtime: bool = True,
                  moves: dict[str, float] | None = None) -> Verification:
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
            op, up to that share of their values differing counted apart.
        runtime: also run the reference in onnxruntime's default session (what a user runs today) and measure how
            far it is from the reference as written; where the candidate is no further, by the median and 90th
            percentile of the per-sample difference and the task's agreement, and op by op every differing integer
            lies on a rounding boundary, an output beyond the default tolerance is accepted (said in the result).
        moves: per integer tensor, how far (in its steps) the candidate's rounded bias can move it
            (``Findings.bias_moves``): a differing value may lie that much further from a rounding boundary."""
    feeds = inputs if inputs is not None else generated_inputs(candidate)
    batched, fixed = batched_inputs(candidate), fixed_batch(candidate)
    check_tensor_sizes(reference, feeds, batched, fixed)  # before a session makes them
    producers = {o: n.op_type for n in candidate.graph.node for o in n.output}
    names = [o.name for o in candidate.graph.output]
    steps = output_steps or {}
    stats = [OutputStats() for _ in names]
    runners = reference_session(reference), session(candidate)  # the converted model must load with defaults
    alternative, refused = runtime_session(reference) if runtime else (None, "")
    alternative = Tolerant(alternative) if alternative is not None else None
    stats_rt = [OutputStats() for _ in names] if alternative is not None else None
    samples, per_sample = 0, 0
    for ref, got, *theirs in _paired_chunks(runners + ((alternative,) if alternative is not None else ()), feeds,
                                            batched, fixed):
        samples += int(ref[0].shape[0]) if ref and ref[0].ndim else 1
        per_sample = max(per_sample, sum(r.nbytes + g.nbytes for r, g in zip(ref, got)) // max(
            int(ref[0].shape[0]) if ref and ref[0].ndim else 1, 1))
        mine = [stat.add(r, g) for stat, r, g in zip(stats, ref, got)]
        for stat, stat_rt, r, t, hits in zip(stats, stats_rt or [], ref, theirs[0] if theirs else [], mine):
            stat.pair(hits, stat_rt.add(r, t))  # each side's task hits computed once, by add
    if alternative is not None and alternative.refused:  # no alternative to compare with: said in the result
        refused, stats_rt = alternative.refused, None
    # their memory (a float reference's dequantized weights) goes before the op-by-op sessions are made
    del runners, alternative
    dead = [name for s, name in zip(stats, names) if s.count and s.nonfinite == s.count]
    if dead:
        raise NonFiniteReferenceError(dead)
    copy = _copyable(reference)  # loaded once for the checks below (None: too large to copy; end to end only)
    share = FLOAT_ONLY_SHARE if copy is not None and float_only(copy, candidate) else FLOAT_SHARE
    outputs = tuple(s.diff(name, producers.get(name, ""), steps.get(name, output_step), share)
                    for s, name in zip(stats, names))
    if stats_rt is not None:  # onnxruntime's own session beside it: recal's model may be as far as that, op by op clean
        outputs = tuple(replace(o, runtime=rt.diff(o.name, producers.get(o.name, ""), o.step, share))
                        if o.kind == "float" else o for o, rt in zip(outputs, stats_rt))
    diff = max((o.max_abs_diff for o in outputs if o.kind != "class ids"), default=0.0)
    span = max((o.output_range for o in outputs if o.kind != "class ids"), default=0.0)
    first = stats[0] if stats else OutputStats()
    agreement = first.argmax_agree / first.argmax_rows if first.argmax_rows else None
    sample = np.concatenate([s.sample() for s in stats]) if stats else np.zeros(0)
    median = float(np.median(sample)) if sample.size else 0.0
    first_step = next((o.step for o in outputs if o.kind == "float"), output_step)
    result = Verification(diff, span, agreement, samples, first_step, median_abs_diff=median, outputs=outputs,
                          runtime_refused=refused)
    if copy is None:
        return result
    result = op_by_op(copy, candidate, feeds, result, thinned or {}, per_sample, tied or {}, moves or {})
    if result.explained:
        result = replace(result, outputs=tuple(replace(o, explained=True) for o in result.outputs))
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


def run_batches(sess, feeds: dict[str, np.ndarray], fixed: int | None) -> list[np.ndarray]:
    """``sess`` on ``feeds``, one fixed batch at a time where ``fixed`` splits them, outputs concatenated."""
    split = fixed_parts(feeds, fixed)
    if split is None:
        return sess.run(None, feeds)
    parts = [sess.run(None, part) for part in split]
    if any(np.ndim(o) == 0 or np.shape(o)[0] != fixed for o in parts[0]):
        return parts[0]  # an output that does not follow the batch: the first batch's alone
    return [np.concatenate(outs) for outs in zip(*parts)]


def runtime_refusal(reference: onnx.ModelProto | str, inputs: dict[str, np.ndarray] | None = None) -> str | None:
    """onnxruntime's reason for refusing the input model as written, loaded and run on the first sample of
    ``inputs`` (generated where None), or None when it runs (or cannot be tried)."""
    try:
        model = onnx.load(reference, load_external_data=False) if isinstance(reference, str) else reference
        if inputs is None:
            feeds = generated_inputs(model, 1)
        else:
            fixed = fixed_batch(model)
            feeds = {k: v[:fixed or 1] if np.ndim(v) else v for k, v in inputs.items()}
        reference_session(reference).run(None, feeds)
    except (MemoryError, ModelError):
        return None
    except Exception as exc:  # noqa: BLE001 - its message is the answer
        return " ".join(str(exc).split())[:500]
    return None
