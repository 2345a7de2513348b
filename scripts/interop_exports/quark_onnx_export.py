"""AMD Quark's post-training quantization of ONNX models (``quark.onnx.ModelQuantizer``), into
tests/fixtures/interop/quark-{xint8,a8w8}-{bert,resnet}.onnx.

The small BERT and ResNet of ``common.py`` are trained, exported to fp32 ONNX (TorchScript path, batch 1) and
quantized by ``ModelQuantizer(Config(global_quant_config=get_default_config(name))).quantize_model(...)`` on real text
windows / the calibration batches, with two of its default configurations:

- ``XINT8`` (its default for Ryzen AI): int8 activations and weights on power-of-two scales, and biases quantized
  as weights are (int8 on a power-of-two grid, not int32), average pools rewritten as a pool and a Mul;
- ``A8W8``: int8 activations and weights, written as onnxruntime's ``com.microsoft`` Q/DQ.

Quark also turns each MatMul + Add into a Gemm. Installed beside this project's ``.venv`` (it runs from its ONNX side
alone):

    .venv/bin/pip install --no-deps --target /tmp/quark_site amd-quark onnxslim zstandard
    PYTHONPATH=/tmp/quark_site .venv/bin/python scripts/interop_exports/quark_onnx_export.py
"""

import os
import tempfile
from pathlib import Path

from onnxruntime.quantization import CalibrationDataReader
from quark.onnx import ModelQuantizer
from quark.onnx.quantization.config import Config, get_default_config

from common import FIXTURES, fp32_for_onnx_quantizers


class Reader(CalibrationDataReader):
    def __init__(self, items):
        self.items = iter(items)

    def get_next(self):
        return next(self.items, None)


with tempfile.TemporaryDirectory() as folder:
    os.chdir(folder)  # Quark writes a record of what it quantized to the working directory
    fp32 = fp32_for_onnx_quantizers(Path(folder))  # only the quantizer's inputs
    for config in ("XINT8", "A8W8"):
        for name, (path, feeds) in fp32.items():
            out = FIXTURES / f"quark-{config.lower()}-{name}.onnx"
            ModelQuantizer(Config(global_quant_config=get_default_config(config))).quantize_model(
                str(path), str(out), Reader(feeds))
            print("wrote", out)
