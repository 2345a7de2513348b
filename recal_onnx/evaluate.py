"""Measure an ONNX classifier artefact for ``recal train``: accuracy on the digits test set, weight
sparsity, file size and median batch-1 latency, all in onnxruntime (default session options)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

from recal_core.datasets import load_digits
from recal_core.training import median_latency_ms, overall_sparsity

WEIGHT_INPUTS = {"Conv": (1,), "Gemm": (1,), "MatMul": (1,), "QLinearConv": (3,), "QGemm": (3,),
                 "QLinearMatMul": (3,), "MatMulIntegerToFloat": (1,), "DequantizeLinear": (0,)}


def weight_sparsity(model: onnx.ModelProto) -> dict[str, float]:
    """Zero fraction of every weight initializer (>= 2-D) read by a conv, dense or weight-dequantize node."""
    initializers = {t.name: t for t in model.graph.initializer}
    result = {}
    for node in model.graph.node:
        for index in WEIGHT_INPUTS.get(node.op_type, ()):
            name = node.input[index] if index < len(node.input) else ""
            tensor = initializers.get(name)
            if tensor is not None and len(tensor.dims) >= 2 and name not in result:
                value = numpy_helper.to_array(tensor)
                result[name] = float((value == 0).sum()) / value.size
    return result


def evaluate(artefact, repeat: int = 200) -> None:
    """Fill ``artefact`` (a :class:`recal_core.training.Artefact` with an ``.onnx`` path) in place."""
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
    from .convert import quantize_qat_export

    quantize_qat_export(src, dst)
