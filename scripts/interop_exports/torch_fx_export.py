"""PyTorch's own QAT before PT2E, FX graph mode (``torch.ao.quantization``, still in torch 2.13 and in its
tutorials), at its documented x86 defaults, into tests/fixtures/interop/torch-fx-small-resnet.onnx.

The float SmallResNet (``common.py``) is trained a few steps, prepared by ``prepare_qat_fx`` with
``get_default_qat_qconfig_mapping("x86")`` (uint8 activations on 7 bits, int8 weights per channel, its fused
moving-average fake quantizers), QAT-trained a few steps, converted by ``convert_fx`` to PyTorch's quantized ops and
exported by torch.onnx's TorchScript path, which writes them as QuantizeLinear / DequantizeLinear around float ops
(the fake-quantized model itself does not export: torch.onnx has no form of ``fused_moving_avg_obs_fake_quant``,
and the dynamo path does not take the converted model). Needs only torch: runs in the project's own venv.

    .venv/bin/python scripts/interop_exports/torch_fx_export.py
"""

import torch
from torch.ao.quantization import get_default_qat_qconfig_mapping
from torch.ao.quantization.quantize_fx import convert_fx, prepare_qat_fx

from common import SIZE, SmallResNet, export_torchscript, trained

torch.manual_seed(0)
model = trained(SmallResNet())
prepared = prepare_qat_fx(model.train(), get_default_qat_qconfig_mapping("x86"), (torch.randn(1, 3, SIZE, SIZE),))
prepared = trained(prepared, steps=10, seed=1)  # QAT
export_torchscript(convert_fx(prepared), "torch-fx-small-resnet.onnx", opset=17)
