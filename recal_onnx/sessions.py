"""The onnxruntime sessions verification runs: the input model as written (its meaning), as onnxruntime runs it by
default (what a user runs today), and the converted model."""

from __future__ import annotations

from typing import TYPE_CHECKING

import onnx

if TYPE_CHECKING:
    import onnxruntime as ort


def session(model: onnx.ModelProto | str, threads: int | None = None, level: ort.GraphOptimizationLevel | None = None,
            order: ort.ExecutionOrder | None = None, quiet: bool = False) -> ort.InferenceSession:
    """An onnxruntime CPU session on ``model``, as recal's verification and benchmarks make them.

    Args:
        model: the model, or its path.
        threads: intra-op threads (onnxruntime's default when None).
        level: a ``GraphOptimizationLevel`` (the default session's when None).
        order: an ``ExecutionOrder``.
        quiet: drop onnxruntime's errors from the log too (its warnings always are).
    """
    import onnxruntime as ort

    options = ort.SessionOptions()
    # its warnings on the files compared (an initializer also an input...): noise here; ``quiet``, its errors too
    options.log_severity_level = 4 if quiet else 3
    if level is not None:
        options.graph_optimization_level = level
    if order is not None:
        options.execution_order = order
    if threads:
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
    source = model if isinstance(model, str) else model.SerializeToString()
    return ort.InferenceSession(source, options, providers=["CPUExecutionProvider"])


def runtime_session(model: onnx.ModelProto | str):
    """``(session, "")``: onnxruntime's default session of ``model`` (what a user runs the QDQ file with); or
    ``(None, its reason)`` where it does not load (a QDQ model some fusion of onnxruntime's refuses); wrap it in
    :class:`Tolerant` for one that loads and then fails."""
    try:
        return session(model, quiet=True), ""  # a failure is said in the result, not logged
    except Exception as exc:  # noqa: BLE001 - then there is no such alternative to compare with: said in the result
        return None, " ".join(str(exc).split())[:300]


class Tolerant:
    """A session whose failure at run time is a finding, not an error: onnxruntime's default session of a QDQ file
    may load and then fail in a kernel its fusions chose (a per-input-channel weight scale fused into QLinearConv).
    After a failure ``run`` returns no outputs and ``refused`` says why."""

    def __init__(self, inner):
        self.inner, self.refused = inner, ""

    def run(self, names, feeds):
        if self.refused:
            return []
        try:
            return self.inner.run(names, feeds)
        except Exception as exc:  # noqa: BLE001 - onnxruntime's kernels fail in their own types
            self.refused = "it fails when run: " + " ".join(str(exc).split())[:300]
            return []


def reference_session(model: onnx.ModelProto | str) -> ort.InferenceSession:
    """A session that runs an input QDQ model as written, in float (optimizations disabled).

    That is the model's meaning. At its default level onnxruntime fuses QDQ into integer kernels,
    whose x86 u8s8 variants saturate on CPUs without VNNI (AVX2, AVX-512F): a reference that is
    itself off by whole output steps there.

    Its ops run in priority order: by default onnxruntime starts with every op that reads only initializers, so
    a weight-only decoder dequantized all its weights to float before its first layer (2.4 GB at once for a 0.6 B
    model); in priority order each weight is dequantized near its use (1.1 GB).

    Args:
        model: the QDQ model, or its path.
    """
    import onnxruntime as ort

    return session(model, level=ort.GraphOptimizationLevel.ORT_DISABLE_ALL, order=ort.ExecutionOrder.PRIORITY_BASED)


