"""onnxruntime's own quantizers at their documented settings, and the fidelity every benchmark reports beside speed.

``quantize_static`` as onnxruntime's docs advise for CNNs: ``quant_pre_process`` first, then QDQ, uint8 activations,
int8 per-channel weights, calibrated on the given feeds; as it comes (``reduce_range=False``, 8-bit weights: fast,
but they saturate in the u8s8 kernels of x86 CPUs without VNNI) and with ``reduce_range=True`` (7-bit weights,
onnxruntime's documented remedy for those CPUs). ``quantize_dynamic`` for transformers.
"""

from __future__ import annotations

import time
import warnings
from pathlib import Path

import numpy as np
import onnx

from recal_onnx import reference_session, session

STATIC = "ort quantize_static"
STATIC_REDUCED = "ort quantize_static reduce_range"
DYNAMIC = "ort quantize_dynamic"


def quantize_static(fp32: Path, out: Path, feeds: list[dict[str, np.ndarray]], reduce_range: bool = False,
                    activation_type: str = "QUInt8", per_channel: bool = True, weight_type: str = "QInt8",
                    extra_options: dict | None = None) -> float:
    """onnxruntime's static quantization of ``fp32`` into ``out`` (QDQ, int8 weights; uint8 activations and
    per-channel weights unless told otherwise); returns the seconds it took."""
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType
    from onnxruntime.quantization import quantize_static as ort_quantize_static
    from onnxruntime.quantization.shape_inference import quant_pre_process

    class Reader(CalibrationDataReader):
        def __init__(self):
            self.items = iter(feeds)

        def get_next(self):
            return next(self.items, None)

    started = time.perf_counter()
    prepared = out.with_suffix(".pre.onnx")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        quant_pre_process(str(fp32), str(prepared), skip_symbolic_shape=True)
        ort_quantize_static(str(prepared), str(out), Reader(), quant_format=QuantFormat.QDQ,
                            activation_type=getattr(QuantType, activation_type),
                            weight_type=getattr(QuantType, weight_type),
                            per_channel=per_channel,
                            reduce_range=reduce_range, extra_options=extra_options)
    prepared.unlink()
    return time.perf_counter() - started


def matmul_nbits_qdq(fp32: Path, out: Path, block_size: int = 32, symmetric: bool = True) -> float:
    """onnxruntime's weight-only 4-bit quantization of every MatMul in QDQ form (opset-21 blocked int4 / uint4
    DequantizeLinear); seconds taken."""
    from onnxruntime.quantization import QuantFormat
    from onnxruntime.quantization.matmul_nbits_quantizer import DefaultWeightOnlyQuantConfig, MatMulNBitsQuantizer

    started = time.perf_counter()
    config = DefaultWeightOnlyQuantConfig(block_size=block_size, is_symmetric=symmetric,
                                          quant_format=QuantFormat.QDQ)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        quantizer = MatMulNBitsQuantizer(onnx.load(str(fp32)), algo_config=config)
        quantizer.process()
        quantizer.model.save_model_to_file(str(out))
    return time.perf_counter() - started


def quantize_dynamic(fp32: Path, out: Path) -> float:
    """onnxruntime's dynamic quantization (int8 weights, activations quantized at run time); seconds taken."""
    from onnxruntime.quantization import QuantType
    from onnxruntime.quantization import quantize_dynamic as ort_quantize_dynamic

    started = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ort_quantize_dynamic(str(fp32), str(out), weight_type=QuantType.QInt8)
    return time.perf_counter() - started


def static_peers(fp32: Path, folder: Path, feeds: list[dict[str, np.ndarray]]) -> dict[str, Path]:
    """Both ``quantize_static`` settings of ``fp32``, by label."""
    paths = {STATIC: folder / "quantize_static.onnx", STATIC_REDUCED: folder / "quantize_static.reduce_range.onnx"}
    quantize_static(fp32, paths[STATIC], feeds)
    quantize_static(fp32, paths[STATIC_REDUCED], feeds, reduce_range=True)
    return paths


def fidelity(path: Path, reference: Path, feed: dict[str, np.ndarray], chunk: int = 16) -> tuple[float, float]:
    """``path`` in a default onnxruntime session (what users run) against ``reference`` run as written (float,
    optimizations off): argmax agreement over the batch ``feed``, and the largest difference as a share of the
    reference outputs' range."""
    got_session, ref_session = session(str(path)), reference_session(str(reference))
    name = got_session.get_inputs()[0].name
    (batch,) = feed.values()
    agree, worst, low, high = 0, 0.0, np.inf, -np.inf
    for start in range(0, len(batch), chunk):
        x = {name: batch[start:start + chunk]}
        got, ref = got_session.run(None, x)[0], ref_session.run(None, x)[0]
        agree += int(np.sum(got.reshape(len(got), -1).argmax(1) == ref.reshape(len(ref), -1).argmax(1)))
        worst = max(worst, float(np.abs(got - ref).max()))
        low, high = min(low, float(ref.min())), max(high, float(ref.max()))
    return agree / len(batch), worst / max(high - low, 1e-12)
