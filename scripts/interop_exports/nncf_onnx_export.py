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
import torch

import common
from common import FIXTURES, SmallResNet, calibration, small_bert, text_batches, trained, trained_on_text

torch.manual_seed(0)
bert = trained_on_text(small_bert())
resnet = trained(SmallResNet())
with tempfile.TemporaryDirectory() as folder:
    common.FIXTURES = Path(folder)  # the fp32 exports are only the quantizer's inputs
    common.export_text_model(bert, "bert.onnx", opset=17)
    common.export_torchscript(resnet, "resnet.onnx", opset=17)
    text = [{"input_ids": window[None].numpy()} for ids, _ in text_batches(4, seed=1) for window in ids]
    images = [{"input": x[i:i + 1].numpy()} for x in calibration() for i in range(len(x))]
    for name, items, model_type in (("bert", text, nncf.ModelType.TRANSFORMER), ("resnet", images, None)):
        quantized = nncf.quantize(onnx.load(Path(folder) / f"{name}.onnx"), nncf.Dataset(items),
                                  model_type=model_type, subset_size=len(items))
        onnx.save(quantized, FIXTURES / f"nncf-onnx-int8-{name}.onnx")
        print("wrote", FIXTURES / f"nncf-onnx-int8-{name}.onnx")
