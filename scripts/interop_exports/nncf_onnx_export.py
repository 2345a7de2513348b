"""NNCF's post-training quantization of ONNX models (its ONNX backend: ``nncf.quantize`` on an ``onnx.ModelProto``),
into tests/fixtures/interop/nncf-onnx-int8-bert.onnx and nncf-onnx-int8-resnet.onnx.

The small BERT and ResNet of ``common.py`` are trained, exported to fp32 ONNX (TorchScript path, batch 1) and
quantized by ``nncf.quantize(model, nncf.Dataset(...))`` at its defaults (the BERT with
``model_type=nncf.ModelType.TRANSFORMER``), calibrated on real text windows / the calibration batches: int8 QDQ with
int8 weights per channel, and on the BERT its SmoothQuant scales, int8 embedding tables and quantized Q·Kᵀ.
NNCF's ONNX side needs neither torch nor OpenVINO; installed beside this project's ``.venv``:

    .venv/bin/pip install --no-deps --target /tmp/nncf_site nncf openvino-telemetry pydot networkx tabulate
    PYTHONPATH=/tmp/nncf_site .venv/bin/python scripts/interop_exports/nncf_onnx_export.py
"""

import tempfile
from pathlib import Path

import nncf
import onnx

from common import FIXTURES, fp32_for_onnx_quantizers

with tempfile.TemporaryDirectory() as folder:
    for name, (path, feeds) in fp32_for_onnx_quantizers(Path(folder)).items():
        model_type = nncf.ModelType.TRANSFORMER if name == "bert" else None
        quantized = nncf.quantize(onnx.load(path), nncf.Dataset(feeds), model_type=model_type, subset_size=len(feeds))
        onnx.save(quantized, FIXTURES / f"nncf-onnx-int8-{name}.onnx")
        print("wrote", FIXTURES / f"nncf-onnx-int8-{name}.onnx")
