"""Run two ONNX models in onnxruntime (default session options) on the same inputs and compare outputs."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx

_NP_TYPES = {onnx.TensorProto.FLOAT: np.float32, onnx.TensorProto.DOUBLE: np.float64,
             onnx.TensorProto.INT64: np.int64, onnx.TensorProto.INT32: np.int32, onnx.TensorProto.UINT8: np.uint8,
             onnx.TensorProto.INT8: np.int8, onnx.TensorProto.FLOAT16: np.float16, onnx.TensorProto.BOOL: np.bool_}


@dataclass
class Verification:
    max_abs_diff: float
    output_range: float
    argmax_agreement: float | None  # for 2-D outputs
    samples: int

    def problem(self, tolerance: float | None, min_agreement: float | None = None,
                output_step: float = 0.0) -> str | None:
        """Why the candidate fails, or None. The default tolerance is 10% of the outputs' range, but at
        least 3 steps of a quantized output (rounding differs by a step where values sit on a boundary)."""
        limit = tolerance if tolerance is not None else max(0.1 * self.output_range, 3 * output_step, 1e-4)
        parts = []
        if not np.isfinite(self.max_abs_diff) or self.max_abs_diff > limit:
            parts.append(f"max abs difference {self.max_abs_diff:.4g} > {limit:.4g}")
        if min_agreement is not None and self.argmax_agreement is not None \
                and self.argmax_agreement < min_agreement:
            parts.append(f"argmax agreement {self.argmax_agreement:.4f} < {min_agreement}")
        return "; ".join(parts) or None

    def __str__(self) -> str:
        agree = "" if self.argmax_agreement is None else f", argmax agreement {self.argmax_agreement:.4f}"
        return f"max abs diff {self.max_abs_diff:.4g} (output range {self.output_range:.4g}){agree} on {self.samples} samples"


def session(model: onnx.ModelProto | str, threads: int | None = None, level=None):
    import onnxruntime as ort

    options = ort.SessionOptions()
    if level is not None:
        options.graph_optimization_level = level
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
    """
    import onnxruntime as ort

    return session(model, level=ort.GraphOptimizationLevel.ORT_DISABLE_ALL)


def generated_inputs(model: onnx.ModelProto, batch: int = 256, seed: int = 0) -> dict[str, np.ndarray]:
    """Standard-normal float inputs (uniform integers for integer inputs); symbolic dims become ``batch``/1."""
    rng = np.random.default_rng(seed)
    initializers = {t.name for t in model.graph.initializer}
    feeds = {}
    for info in model.graph.input:
        if info.name in initializers:
            continue
        tensor = info.type.tensor_type
        dims = [d.dim_value if d.HasField("dim_value") else (batch if i == 0 else 1)
                for i, d in enumerate(tensor.shape.dim)]
        dtype = _NP_TYPES.get(tensor.elem_type, np.float32)
        if np.issubdtype(dtype, np.floating):
            feeds[info.name] = rng.standard_normal(dims).astype(dtype)
        else:
            feeds[info.name] = rng.integers(0, 2, dims).astype(dtype)
    return feeds


def verify_models(reference: onnx.ModelProto | str, candidate: onnx.ModelProto,
                  inputs: dict[str, np.ndarray] | None = None) -> Verification:
    """Compare ``candidate`` with ``reference`` (a model or a path) on ``inputs`` (generated if None)."""
    feeds = inputs if inputs is not None else generated_inputs(candidate)
    ref = reference_session(reference).run(None, feeds)
    got = session(candidate).run(None, feeds)  # the converted model must load with default options
    diff = max(float(np.max(np.abs(r.astype(np.float64) - c.astype(np.float64)))) if r.size else 0.0
               for r, c in zip(ref, got))
    span = max(float(np.ptp(r)) if r.size else 0.0 for r in ref)
    agreement = None
    first, other = ref[0], got[0]
    if first.ndim == 2 and first.shape[1] > 1:
        agreement = float(np.mean(first.argmax(1) == other.argmax(1)))
    samples = int(first.shape[0]) if first.ndim else 1
    return Verification(diff, span, agreement, samples)
