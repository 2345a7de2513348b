"""Brevitas's documented flow at its defaults, into tests/fixtures/interop/brevitas-small-resnet.onnx (and the same
model by ``export_qonnx``, QONNX's ``Quant`` nodes, into brevitas-qonnx-small-resnet.onnx, and by its dynamo path into
brevitas-qonnx-dynamo-small-resnet.onnx: the converter reads them as the QCDQ they mean); with 4-bit weights per
channel (its compute layer map's ``Int8WeightPerChannelFloat`` at ``weight_bit_width=4``: QCDQ clips the integers to
+-7) into brevitas-w4-small-resnet.onnx (and by ``export_qonnx`` into brevitas-qonnx-w4-small-resnet.onnx).

The float SmallResNet (``common.py``) is trained a few steps, prepared and quantized by Brevitas's graph mode
(``preprocess_for_quantize`` + ``quantize``: 8-bit weights and activations, int32 biases), calibrated
(``calibration_mode``), QAT-trained a few steps, and exported with ``export_onnx_qcdq`` (QuantizeLinear, Clip,
DequantizeLinear) by its TorchScript path (its dynamo path refuses the int32 biases), batch fixed at
1. Run in a venv with ``torch==2.13.0`` installed first, then ``brevitas``:

    python -m venv /tmp/venv_brevitas && /tmp/venv_brevitas/bin/pip install torch==2.13.0 && \\
        /tmp/venv_brevitas/bin/pip install brevitas onnx onnxscript onnxoptimizer
    /tmp/venv_brevitas/bin/python scripts/interop_exports/brevitas_export.py
"""

import copy
from pathlib import Path

import onnx

import torch
from brevitas.export import export_onnx_qcdq, export_qonnx
from brevitas.graph.calibrate import calibration_mode
from brevitas.graph.quantize import COMPUTE_LAYER_MAP, preprocess_for_quantize, quantize
from brevitas.quant.scaled_int import Int8WeightPerChannelFloat

from common import FIXTURES, SIZE, SmallResNet, calibration, trained

torch.manual_seed(0)
model = trained(SmallResNet())
quant = quantize(preprocess_for_quantize(model))
with torch.no_grad(), calibration_mode(quant):
    for x in calibration():
        quant(x)
quant = trained(quant, steps=10, seed=1)  # QAT
FIXTURES.mkdir(parents=True, exist_ok=True)
export_onnx_qcdq(quant, args=torch.randn(1, 3, SIZE, SIZE), export_path=str(FIXTURES / "brevitas-small-resnet.onnx"),
                 opset_version=13, dynamo=False)  # its dynamo path refuses int32 biases, Brevitas's default
print("wrote", FIXTURES / "brevitas-small-resnet.onnx")
export_qonnx(quant, args=torch.randn(1, 3, SIZE, SIZE), opset_version=13, dynamo=False,
             export_path=str(FIXTURES / "brevitas-qonnx-small-resnet.onnx"))
print("wrote", FIXTURES / "brevitas-qonnx-small-resnet.onnx")
dynamo = FIXTURES / "brevitas-qonnx-dynamo-small-resnet.onnx"
export_qonnx(quant, args=torch.randn(1, 3, SIZE, SIZE), dynamo=True, export_path=str(dynamo))  # torch's opset
onnx.save(onnx.load(dynamo), dynamo)  # one file: torch's dynamo path writes the weights beside it
Path(f"{dynamo}.data").unlink()
print("wrote", dynamo)

four_bit = copy.deepcopy(COMPUTE_LAYER_MAP)
for layer in (torch.nn.Conv2d, torch.nn.Linear):
    four_bit[layer] = (four_bit[layer][0], {**four_bit[layer][1], "weight_quant": Int8WeightPerChannelFloat,
                                            "weight_bit_width": 4})
torch.manual_seed(0)
quant = quantize(preprocess_for_quantize(trained(SmallResNet())), compute_layer_map=four_bit)
with torch.no_grad(), calibration_mode(quant):
    for x in calibration():
        quant(x)
quant = trained(quant, steps=10, seed=1)  # QAT
export_onnx_qcdq(quant, args=torch.randn(1, 3, SIZE, SIZE), export_path=str(FIXTURES / "brevitas-w4-small-resnet.onnx"),
                 opset_version=13, dynamo=False)
print("wrote", FIXTURES / "brevitas-w4-small-resnet.onnx")
export_qonnx(quant, args=torch.randn(1, 3, SIZE, SIZE), opset_version=13, dynamo=False,
             export_path=str(FIXTURES / "brevitas-qonnx-w4-small-resnet.onnx"))
print("wrote", FIXTURES / "brevitas-qonnx-w4-small-resnet.onnx")
