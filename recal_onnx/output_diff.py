"""One graph output of two models compared end to end, in its own units: the running figures kept chunk by chunk
(never the outputs themselves) and the verdict they give (:class:`OutputDiff`). NaN and inf are values: equal where
both models give the same one, an infinite difference where only one does."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

STEPS = 3  # the end-to-end tolerance for a quantized or integer output, in its quantization steps
FLOAT_SHARE = 0.1  # ... for a float output: a share of its range
FLOAT_ONLY_SHARE = 1e-4  # ... when neither model quantizes an activation (weight-only layers dequantizing in float):
# the same float arithmetic in another order, which moves a decoder's logits by about 1e-6 of their range
CLASS_AGREEMENT = 0.95  # ... for class ids (ArgMax, TopK indices): the share that must agree
CLASS_ID_OPS = {"ArgMax", "ArgMin", "TopK"}
MEDIAN_SAMPLE = 1_000_000  # differences kept per output for the median
RUNTIME_MARGIN = 0.1  # "as close as onnxruntime's own session": its per-sample median and p90 plus this share of them
RUNTIME_TASK = 0.005  # ... and its task agreement less this (both models' roundings drawn on the same few samples)
RUNTIME_Z = 2.0  # ... or, paired, fewer results lost than won plus this many standard deviations (1 in 44 by chance)


@dataclass(frozen=True)
class OutputDiff:
    """One graph output compared end to end, in its own units."""

    name: str
    kind: str  # "float", "integer" (a quantized or integer tensor), "class ids" or "bool" (must be equal)
    max_abs_diff: float
    output_range: float
    step: float = 0.0  # a float output written by a DequantizeLinear: its quantization step; an integer one: 1
    agreement: float | None = None  # class ids: the share equal
    noise: float | None = None  # the QAT model's own max abs difference under 8-ulp nudges (rounding_noise)
    share: float = FLOAT_SHARE  # a float output's tolerance, as a share of its range
    magnitude: float = 0.0  # the reference's largest |value|: two float32 outputs so large are apart by a ulp of it
    # per sample max abs difference: (median, 90th percentile), as shares of the range
    typical: tuple[float, float] | None = None
    task: float | None = None  # the task's agreement: top-1 per position (last axis), or a 0.5-thresholded [0, 1] map
    # the same figures for onnxruntime's own default session of the input file against it as written: what the user
    # runs today, whose distance from the file's meaning a conversion may match (:meth:`as_close_as_runtime`)
    runtime: "OutputDiff | None" = None
    explained: bool = False  # op by op, every differing integer lay on a rounding boundary (no misreading seen)
    # task results read otherwise by this model and onnxruntime's own session: (only theirs agrees, only this one)
    task_paired: tuple[int, int] | None = None

    def as_close_as_runtime(self) -> bool:
        """At least as close to the input model run as written as onnxruntime's default session of it is, by the
        median and 90th percentile of the per-sample difference and by the task's agreement, within the sampling
        noise of a few dozen samples (:data:`RUNTIME_MARGIN`, :data:`RUNTIME_TASK`)."""
        rt = self.runtime
        if (not self.explained or rt is None or self.typical is None or rt.typical is None
                or not np.isfinite(self.max_abs_diff)):
            return False
        close = all(mine <= theirs * (1 + RUNTIME_MARGIN) + 1e-6 for mine, theirs in zip(self.typical, rt.typical))
        return close and (self.task is None or rt.task is None or self.task >= rt.task - RUNTIME_TASK
                          or self._task_not_worse()) and rt.max_abs_diff > 0

    def _task_not_worse(self) -> bool:
        """Paired (McNemar's test): of the task results the two read otherwise, this model loses no more than
        chance would, :data:`RUNTIME_Z` standard deviations, if both were as good (each flip a coin toss)."""
        if self.task_paired is None:
            return False
        worse, better = self.task_paired
        return worse - better <= RUNTIME_Z * math.sqrt(worse + better)

    def typical_note(self) -> str:
        """The per-sample figures beside onnxruntime's own session's, in one clause."""
        def fig(d):
            task = "" if d.task is None else f", task agreement {d.task:.4f}"
            return f"per-sample difference median {d.typical[0]:.3g}, p90 {d.typical[1]:.3g} of range{task}"
        if self.typical is None:
            return ""
        own = f"output {self.name!r}: recal {fig(self)}"
        if self.runtime is None or self.runtime.typical is None:
            return own
        paired = "" if self.task_paired is None else \
            (f" (of the {sum(self.task_paired)} task results the two read otherwise, recal's alone agree on "
             f"{self.task_paired[1]}, onnxruntime's alone on {self.task_paired[0]})")
        return f"{own}; onnxruntime's default session of the input {fig(self.runtime)}{paired}"

    def problem(self, tolerance: float | None, min_agreement: float | None) -> str | None:
        if self.kind == "bool":  # a mask or a decision: no tolerance means anything but equal
            if self.max_abs_diff == 0:
                return None
            differ = 1 - (self.agreement or 0)
            return f"output {self.name!r} (bool): {differ:.2%} of its values differ; bools must be equal"
        if self.kind == "class ids":
            need = CLASS_AGREEMENT if min_agreement is None else min_agreement
            if self.agreement is None or self.agreement < need:
                return f"output {self.name!r} (class ids): {self.agreement} agree, fewer than {need}"
            return None
        # 3 steps of an output dequantized in float32 far from its zero point measure 3 steps give or take a ulp of
        # the value (1e-5 of the step at 127 steps out): the defaults allow two
        ulps = 2 * float(np.spacing(np.float32(self.magnitude)))
        if tolerance is not None:
            limit = tolerance
        elif self.step > 0:
            limit = STEPS * self.step * (1 + 1e-6) + ulps
        else:
            limit = max(self.share * self.output_range, 1e-3 * self.share)
        noise = ""
        if tolerance is None and self.noise is not None:
            limit = max(limit, self.noise * (1 + 1e-6) + ulps)
            noise = f", the QAT model's own rounding noise {self._in_steps(self.noise)}"
        if np.isfinite(self.max_abs_diff) and self.max_abs_diff <= limit:
            return None
        if tolerance is None and self.as_close_as_runtime():
            return None
        return (f"output {self.name!r} ({self.kind}): max abs difference {self._in_steps(self.max_abs_diff)} > "
                f"{limit:.4g}{noise}")

    def _in_steps(self, value: float) -> str:
        return f"{value:.4g} ({value / self.step:.2f} steps)" if self.step > 0 else f"{value:.4g}"




class OutputStats:
    """One graph output compared chunk by chunk: what the comparison needs, never the outputs themselves."""

    def __init__(self):
        self.mismatch = False
        self.max_diff, self.low, self.high = 0.0, math.inf, -math.inf
        self.equal = self.count = self.nonfinite = 0
        self.argmax_agree = self.argmax_rows = 0
        self.dtype: np.dtype | None = None
        self.kept: list[np.ndarray] = []
        self.kept_size = 0
        self.per_sample: list[np.ndarray] = []  # each sample's max abs difference
        self.task_agree = self.task_count = 0
        # task results where this candidate and another (onnxruntime's own session) disagree: (only the other is
        # right, only this one is), for a paired judgement of the two (OutputDiff.as_close_as_runtime)
        self.task_worse = self.task_better = 0

    def pair(self, mine: np.ndarray | None, theirs: np.ndarray | None) -> None:
        """Count the task results where this candidate and another differ in agreeing with the reference: ``mine``
        and ``theirs`` are what :meth:`add` returned for each on the same chunk."""
        if mine is not None and theirs is not None and mine.shape == theirs.shape:
            self.task_worse += int(np.count_nonzero(theirs & ~mine))
            self.task_better += int(np.count_nonzero(mine & ~theirs))

    def add(self, ref: np.ndarray, got: np.ndarray) -> np.ndarray | None:
        """Take one chunk in; return where ``got`` reads as ``ref`` for the task (:func:`task_hits`), or None."""
        self.dtype = ref.dtype
        hits = None
        if ref.shape != got.shape:
            self.mismatch = True
            return hits
        diff = np.abs(ref.astype(np.float64) - got.astype(np.float64)).reshape(-1)
        finite = np.isfinite(ref).reshape(-1) if np.issubdtype(ref.dtype, np.floating) else None
        if finite is not None and not finite.all():  # NaN where both are NaN, the same inf: equal; else inf apart
            self.nonfinite += int(np.count_nonzero(~finite))
            r, g = ref.reshape(-1), got.reshape(-1)
            same = (np.isnan(r) & np.isnan(g)) | (~np.isnan(r) & (r == g))
            diff = np.where(same, 0.0, np.where(np.isnan(diff), np.inf, diff))
        elif np.issubdtype(got.dtype, np.floating):
            diff = np.where(np.isnan(diff), np.inf, diff)  # a NaN the reference does not have is a difference
        self.max_diff = max(self.max_diff, float(diff.max(initial=0.0)))
        values = ref.reshape(-1)[finite] if finite is not None else ref
        if values.size:
            self.low, self.high = min(self.low, float(values.min())), max(self.high, float(values.max()))
        self.equal += int(np.count_nonzero(ref == got))
        self.count += int(ref.size)
        if ref.ndim == 2 and ref.shape[1] > 1:
            self.argmax_agree += int(np.count_nonzero(ref.argmax(1) == got.argmax(1)))
            self.argmax_rows += int(ref.shape[0])
        if ref.ndim >= 1 and ref.shape[0] and np.issubdtype(ref.dtype, np.floating):
            self.per_sample.append(diff.reshape(ref.shape[0], -1).max(1, initial=0.0))
            hits = task_hits(ref, got)
            if hits is not None:
                self.task_agree += int(np.count_nonzero(hits))
                self.task_count += int(hits.size)
        room = MEDIAN_SAMPLE - self.kept_size
        if room > 0 and diff.size:
            stride = max(1, -(-diff.size // room))
            self.kept.append(diff[::stride].copy())
            self.kept_size += self.kept[-1].size
        return hits

    def sample(self) -> np.ndarray:
        return np.concatenate(self.kept) if self.kept else np.zeros(0)

    def diff(self, name: str, producer: str, step: float, share: float = FLOAT_SHARE) -> OutputDiff:
        """The output in its own units (see :class:`OutputDiff`); ``share``: a float output's tolerance."""
        dtype = self.dtype if self.dtype is not None else np.dtype(np.float32)
        integer = np.issubdtype(dtype, np.integer)
        if self.mismatch:
            return OutputDiff(name, "integer" if integer else "float", math.inf, 0.0)
        span = self.high - self.low if self.count else 0.0
        if producer in CLASS_ID_OPS or (integer and dtype.itemsize >= 4 and producer != "QuantizeLinear"):
            return OutputDiff(name, "class ids", self.max_diff, 0.0,
                              agreement=self.equal / self.count if self.count else 1.0)
        if dtype == np.bool_:
            return OutputDiff(name, "bool", self.max_diff, 1.0,
                              agreement=self.equal / self.count if self.count else 1.0)
        if integer:
            return OutputDiff(name, "integer", self.max_diff, span, step=1.0)
        magnitude = max(abs(self.low), abs(self.high))  # inf where no value was finite
        typical = None
        if self.per_sample and span > 0:
            samples = np.concatenate(self.per_sample) / span
            typical = (float(np.median(samples)), float(np.percentile(samples, 90)))
        return OutputDiff(name, "float", self.max_diff, span, step=step, share=share,
                          magnitude=magnitude if math.isfinite(magnitude) else 0.0, typical=typical,
                          task=self.task_agree / self.task_count if self.task_count else None,
                          task_paired=((self.task_worse, self.task_better) if self.task_worse + self.task_better
                                       else None))


def task_hits(ref: np.ndarray, got: np.ndarray) -> np.ndarray | None:
    """Where ``got`` reads as ``ref`` does for the task: top-1 per position where the last axis holds classes, a
    map of probabilities thresholded at 0.5; None for another float output (or shapes apart). This is the agreement
    verification's ``min_agreement`` counts.

    Args:
        ref: the reference model's output.
        got: the converted model's output.
    """
    if ref.shape != got.shape or ref.ndim < 1 or not np.issubdtype(ref.dtype, np.floating):
        return None
    if ref.ndim >= 2 and ref.shape[-1] > 1:
        return (ref.argmax(-1) == got.argmax(-1)).reshape(-1)
    finite = ref[np.isfinite(ref)]
    if finite.size and finite.min() >= 0 and finite.max() <= 1:
        return ((ref > 0.5) == (got > 0.5)).reshape(-1)
    return None


def float_gap(got: np.ndarray, ref: np.ndarray) -> float:
    """The largest difference of a float output as a share of the reference's finite range: NaN where both are NaN
    (and the same inf) is no difference; a NaN or inf on one side alone is an infinite one."""
    got, ref = got.astype(np.float64), ref.astype(np.float64)
    same = (np.isnan(got) & np.isnan(ref)) | (got == ref)
    diff = np.where(same, 0.0, np.abs(got - ref))
    finite = ref[np.isfinite(ref)]
    span = float(np.ptp(finite)) if finite.size else 0.0
    return float(np.nan_to_num(diff, nan=np.inf).max(initial=0.0)) / max(span, 1e-12)
