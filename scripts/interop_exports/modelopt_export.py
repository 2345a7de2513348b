"""NVIDIA ModelOpt's documented QAT flow at its defaults, into tests/fixtures/interop/modelopt-small-resnet.onnx.

The float SmallResNet (``common.py``) is trained a few steps, quantized by ``mtq.quantize`` with
``mtq.INT8_DEFAULT_CFG`` (int8 per-channel weights, int8 per-tensor activations, calibrated by a forward loop over
synthetic batches), fine-tuned a few steps (QAT) and exported by ``torch.onnx.export`` (TorchScript path, its
quantizers written as QuantizeLinear/DequantizeLinear; fixed batch of 1). Run in a venv with ``torch==2.13.0``
installed first, then ModelOpt (which imports requests and huggingface_hub without declaring them):

    python -m venv /tmp/venv_mo && /tmp/venv_mo/bin/pip install torch==2.13.0 && \\
        /tmp/venv_mo/bin/pip install nvidia-modelopt onnx onnxscript requests huggingface_hub
    /tmp/venv_mo/bin/python scripts/interop_exports/modelopt_export.py
"""

import modelopt.torch.quantization as mtq
import torch

from common import SmallResNet, calibration, export_torchscript, trained

torch.manual_seed(0)
model = trained(SmallResNet())


def forward_loop(m):
    with torch.no_grad():
        for x in calibration():
            m(x)


quantized = trained(mtq.quantize(model, mtq.INT8_DEFAULT_CFG, forward_loop), steps=10, seed=1)  # QAT
export_torchscript(quantized, "modelopt-small-resnet.onnx", opset=17)
