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

import torch
from onnxruntime.quantization import CalibrationDataReader
from quark.onnx import ModelQuantizer
from quark.onnx.quantization.config import Config, get_default_config

import common
from common import FIXTURES, SmallResNet, calibration, small_bert, text_batches, trained, trained_on_text


class Reader(CalibrationDataReader):
    def __init__(self, items):
        self.items = iter(items)

    def get_next(self):
        return next(self.items, None)


torch.manual_seed(0)
bert = trained_on_text(small_bert())
resnet = trained(SmallResNet())
with tempfile.TemporaryDirectory() as folder:
    os.chdir(folder)  # Quark writes a record of what it quantized to the working directory
    common.FIXTURES = Path(folder)  # the fp32 exports are only the quantizer's inputs
    common.export_text_model(bert, "bert.onnx", opset=17)
    common.export_torchscript(resnet, "resnet.onnx", opset=17)
    text = [{"input_ids": window[None].numpy()} for ids, _ in text_batches(4, seed=1) for window in ids]
    images = [{"input": x[i:i + 1].numpy()} for x in calibration() for i in range(len(x))]
    for config in ("XINT8", "A8W8"):
        for name, items in (("bert", text), ("resnet", images)):
            out = FIXTURES / f"quark-{config.lower()}-{name}.onnx"
            ModelQuantizer(Config(global_quant_config=get_default_config(config))).quantize_model(
                str(Path(folder) / f"{name}.onnx"), str(out), Reader(items))
            print("wrote", out)
