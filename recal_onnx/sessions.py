"""The onnxruntime sessions verification runs: the input model as written (its meaning), as onnxruntime runs it by
default (what a user runs today), and the converted model."""

from __future__ import annotations

import onnx


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


def runtime_session(model: onnx.ModelProto | str):
    """``(session, "")``: onnxruntime's default session of ``model`` (what a user runs the QDQ file with); or
    ``(None, its reason)`` where it does not load (a QDQ model some fusion of onnxruntime's refuses)."""
    try:
        return session(model), ""
    except Exception as exc:  # noqa: BLE001 - then there is no such alternative to compare with: said in the result
        return None, " ".join(str(exc).split())[:300]


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


