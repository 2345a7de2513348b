"""Measure an ONNX classifier artefact for ``recal train``: accuracy on the digits test set, weight
sparsity, file size and median batch-1 latency, all in onnxruntime (default session options)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

from recal_core.datasets import load_digits
from .measures import median_latency_ms, overall_sparsity

# op -> (index of its weight input, index of that weight's zero point or None)
WEIGHT_INPUTS = {"Conv": (1, None), "Gemm": (1, None), "MatMul": (1, None), "QLinearConv": (3, 5),
                 "QGemm": (3, 5), "QLinearMatMul": (3, 5), "MatMulIntegerToFloat": (1, 5),
                 "DequantizeLinear": (0, 2)}


def _channel_axis(node: onnx.NodeProto) -> int:
    """The axis of a weight's per-channel zero points: output channels for QLinearConv, the N axis of a
    (possibly transposed) QGemm / MatMul weight, DequantizeLinear's own ``axis``."""
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    if node.op_type == "QLinearConv":
        return 0
    if node.op_type == "QGemm":
        return 0 if attrs.get("transB", 0) else 1
    if node.op_type == "DequantizeLinear":
        return int(attrs.get("axis", 1))
    return 1  # QLinearMatMul, MatMulIntegerToFloat: B is [K, N]


def weight_sparsity(model: onnx.ModelProto) -> dict[str, float]:
    """Zero fraction of every weight (>= 2-D) read by a conv, dense or weight-dequantize node.

    A quantized weight is zero where it equals its zero point (uint8 weights hold zero as 128). A float weight
    quantized in the graph (``w -> QuantizeLinear -> DequantizeLinear``, as tf2onnx writes a TF QAT model's
    weights, and ``w -> DequantizeLinear`` through an ``Identity``) is read where the chain starts: its zeros
    are the quantized zeros (symmetric weights: zero point 0, and 0 quantizes to it exactly).
    """
    initializers = {t.name: t for t in model.graph.initializer}
    producers = {o: n for n in model.graph.node for o in n.output}
    result = {}
    for node in model.graph.node:
        index, zp_index = WEIGHT_INPUTS.get(node.op_type, (None, None))
        name = node.input[index] if index is not None and index < len(node.input) else ""
        source = _float_weight_behind(name, initializers, producers) if node.op_type == "DequantizeLinear" else None
        if source is not None:
            if source not in result:
                value = numpy_helper.to_array(initializers[source])
                result[source] = float((value == 0).sum()) / value.size
            continue
        tensor = initializers.get(name)
        if tensor is None or len(tensor.dims) < 2 or name in result:
            continue
        value = numpy_helper.to_array(tensor)
        zp_name = node.input[zp_index] if zp_index is not None and zp_index < len(node.input) else ""
        zero = numpy_helper.to_array(initializers[zp_name]) if zp_name in initializers else np.zeros(())
        if zero.size > 1:  # per channel: along the axis the op quantizes its weight on
            axis = _channel_axis(node)
            zero = zero.reshape([-1 if a == axis else 1 for a in range(value.ndim)])
        result[name] = float((value == zero).sum()) / value.size
    return result


def _float_weight_behind(name: str, initializers: dict, producers: dict) -> str | None:
    """The float initializer (>= 2-D) a DequantizeLinear's input is quantized from, through a QuantizeLinear and
    Identity nodes; None when the input is not such a chain."""
    node = producers.get(name)
    while node is not None and node.op_type == "Identity":
        name, node = node.input[0], producers.get(node.input[0])
    if node is None or node.op_type != "QuantizeLinear":
        return None
    source = node.input[0]
    while source in producers and producers[source].op_type == "Identity":
        source = producers[source].input[0]
    tensor = initializers.get(source)
    return source if tensor is not None and len(tensor.dims) >= 2 else None


def evaluate(artefact, repeat: int = 200) -> None:
    """Fill ``artefact`` (a :class:`recal_app.training.Artefact` with an ``.onnx`` path) in place."""
    import onnxruntime as ort

    path = Path(artefact.path)
    model = onnx.load(str(path))
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    meta = session.get_inputs()[0]
    digits = load_digits()
    shape = [d if isinstance(d, int) else -1 for d in meta.shape]
    images = digits.test_images.reshape([len(digits.test_images), *shape[1:]]).astype(np.float32)
    logits = session.run(None, {meta.name: images})[0]
    artefact.accuracy = float((logits.argmax(1) == digits.test_labels).mean())
    one = {meta.name: images[:1]}
    artefact.latency_ms = median_latency_ms(lambda: session.run(None, one), repeat=repeat)
    layers = weight_sparsity(model)
    sizes = {t.name: int(np.prod(t.dims)) for t in model.graph.initializer if t.name in layers}
    artefact.layer_sparsity = layers
    artefact.sparsity = overall_sparsity(layers, sizes)
    artefact.size_bytes = path.stat().st_size
    artefact.runtime = f"onnxruntime {ort.__version__}"


def quantize(src: str, dst: str) -> None:
    from recal_onnx.convert import quantize_qat_export

    quantize_qat_export(src, dst)
