"""Run two ONNX models in onnxruntime (default session options) on the same inputs and compare outputs."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx

_NP_TYPES = {onnx.TensorProto.FLOAT: np.float32, onnx.TensorProto.DOUBLE: np.float64,
             onnx.TensorProto.INT64: np.int64, onnx.TensorProto.INT32: np.int32, onnx.TensorProto.UINT8: np.uint8,
             onnx.TensorProto.INT8: np.int8, onnx.TensorProto.FLOAT16: np.float16, onnx.TensorProto.BOOL: np.bool_}


STEPS = 3  # the default tolerance for a quantized output, in its quantization steps


@dataclass
class Verification:
    max_abs_diff: float
    output_range: float
    argmax_agreement: float | None  # for 2-D outputs
    samples: int
    output_step: float = 0.0  # the quantization step of a quantized output (0: the output is float)

    @property
    def max_steps(self) -> float | None:
        """The largest difference in output quantization steps (None for a float output)."""
        return self.max_abs_diff / self.output_step if self.output_step > 0 else None

    def problem(self, tolerance: float | None, min_agreement: float | None = None) -> str | None:
        """Why the candidate fails, or None. The default tolerance is 3 steps of a quantized output (rounding
        differs by a step where a value sits on a boundary, and such differences can add up over a few ops);
        for a float output, 10% of the outputs' range."""
        if tolerance is not None:
            limit = tolerance
        elif self.output_step > 0:
            limit = STEPS * self.output_step * (1 + 1e-6)
        else:
            limit = max(0.1 * self.output_range, 1e-4)
        parts = []
        if not np.isfinite(self.max_abs_diff) or self.max_abs_diff > limit:
            steps = "" if self.max_steps is None else f" ({self.max_steps:.2f} output steps)"
            parts.append(f"max abs difference {self.max_abs_diff:.4g}{steps} > {limit:.4g}")
        if min_agreement is not None and self.argmax_agreement is not None \
                and self.argmax_agreement < min_agreement:
            parts.append(f"argmax agreement {self.argmax_agreement:.4f} < {min_agreement}")
        return "; ".join(parts) or None

    def __str__(self) -> str:
        agree = "" if self.argmax_agreement is None else f", argmax agreement {self.argmax_agreement:.4f}"
        steps = "" if self.max_steps is None else f", {self.max_steps:.2f} output steps"
        return (f"max abs diff {self.max_abs_diff:.4g} (output range {self.output_range:.4g}{steps}){agree} on "
                f"{self.samples} samples")


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


def integer_ranges(model: onnx.ModelProto) -> dict[str, int]:
    """Per integer graph input that indexes a table (``Gather``'s indices, directly or through a ``Cast``,
    ``Reshape``, ``Unsqueeze``, ``Squeeze`` or ``Identity``): the table's size along the gathered axis."""
    shapes = {t.name: list(t.dims) for t in model.graph.initializer}
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for node in model.graph.node:  # graph order: a (quantized) table's DequantizeLinear comes before its Gather
        for name in node.input:
            consumers.setdefault(name, []).append(node)
        if node.op_type in ("DequantizeLinear", "Identity", "Cast") and node.input and node.input[0] in shapes:
            shapes[node.output[0]] = shapes[node.input[0]]
    ranges = {}
    for info in model.graph.input:
        stack, seen = [info.name], set()
        while stack:
            name = stack.pop()
            if name in seen:
                continue
            seen.add(name)
            for node in consumers.get(name, []):
                if node.op_type == "Gather" and len(node.input) > 1 and node.input[1] == name \
                        and node.input[0] in shapes:
                    axis = next((a.i for a in node.attribute if a.name == "axis"), 0)
                    table = shapes[node.input[0]]
                    size = table[axis % len(table)] if table else 0
                    ranges[info.name] = min(ranges.get(info.name, size), size)
                elif node.op_type in ("Cast", "Reshape", "Unsqueeze", "Squeeze", "Identity") and node.input[0] == name:
                    stack.extend(node.output)
    return ranges


def generated_inputs(model: onnx.ModelProto, batch: int = 256, seed: int = 0) -> dict[str, np.ndarray]:
    """Standard-normal float inputs; symbolic dims become ``batch``/1. Integer inputs: uniform over the table
    they index (a ``Gather``'s size: token ids cover the vocabulary), ones for an input named like a mask
    (attention masks), otherwise {0, 1}."""
    rng = np.random.default_rng(seed)
    initializers = {t.name for t in model.graph.initializer}
    ranges = integer_ranges(model)
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
        elif info.name in ranges and ranges[info.name] > 0:
            feeds[info.name] = rng.integers(0, ranges[info.name], dims).astype(dtype)
        elif "mask" in info.name.lower():
            feeds[info.name] = np.ones(dims, dtype)
        else:
            feeds[info.name] = rng.integers(0, 2, dims).astype(dtype)
    return feeds


def verify_models(reference: onnx.ModelProto | str, candidate: onnx.ModelProto,
                  inputs: dict[str, np.ndarray] | None = None, output_step: float = 0.0) -> Verification:
    """Compare ``candidate`` with ``reference`` (a model or a path) on ``inputs`` (generated if None);
    ``output_step``: the outputs' quantization step, when they are quantized."""
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
    return Verification(diff, span, agreement, samples, output_step)
