"""NNCF's documented QAT flow at its defaults, into tests/fixtures/interop/nncf-small-resnet.onnx.

The float SmallResNet (``common.py``) is trained a few steps, quantized by ``nncf.quantize`` (8-bit, its default
preset: symmetric int8 weights per channel, activations calibrated on synthetic batches), fine-tuned a few steps
(QAT), stripped with ``nncf.strip`` (NNCF's quantizers become torch's own fake-quantize ops) and exported by
``torch.onnx.export`` (TorchScript path; fixed batch of 1): QuantizeLinear/DequantizeLinear, NNCF's QDQ form. Its
default OpenVINO export (``FakeQuantize``) is a custom-domain op that the converter refuses by name. Run in a venv with
``torch==2.13.0`` installed first, then ``nncf``:

    python -m venv /tmp/venv_nncf && /tmp/venv_nncf/bin/pip install torch==2.13.0 && \\
        /tmp/venv_nncf/bin/pip install nncf onnx onnxscript && /tmp/venv_nncf/bin/pip install --no-deps torchao
    /tmp/venv_nncf/bin/python scripts/interop_exports/nncf_export.py
"""

import nncf
import torch

from common import SIZE, SmallResNet, calibration, export_torchscript, trained

torch.manual_seed(0)
model = trained(SmallResNet())
quantized = nncf.quantize(model, nncf.Dataset(calibration()))
quantized = trained(quantized, steps=10, seed=1)  # QAT
stripped = nncf.strip(quantized, example_input=torch.randn(1, 3, SIZE, SIZE))
export_torchscript(stripped, "nncf-small-resnet.onnx", opset=13)
