"""torchao's PT2E QAT flow at its documented x86 defaults, into tests/fixtures/interop/torchao-pt2e-small-resnet.onnx.

The float SmallResNet (``common.py``) is trained a few steps, captured by ``torch.export`` (batch dynamic), prepared
by ``prepare_qat_pt2e`` with ``X86InductorQuantizer`` at ``get_default_x86_inductor_quantization_config(is_qat=True)``
(uint8 activations, int8 symmetric weights per channel; a conv whose output an Add reads is left unquantized there,
for inductor's fused conv-add), calibrated, QAT-trained a few steps, converted by ``convert_pt2e`` and exported by
``torch.onnx.export(dynamo=True)``, whose translation of ``quantized_decomposed`` ops writes QuantizeLinear /
DequantizeLinear. Run in a venv with ``torch==2.13.0`` installed first, then torchao without its dependencies:

    python -m venv /tmp/venv_nncf && /tmp/venv_nncf/bin/pip install torch==2.13.0 && \\
        /tmp/venv_nncf/bin/pip install onnx onnxscript && /tmp/venv_nncf/bin/pip install --no-deps torchao
    /tmp/venv_nncf/bin/python scripts/interop_exports/torchao_pt2e_export.py
"""

import warnings

import torch
from torchao.quantization.pt2e import allow_exported_model_train_eval
from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_qat_pt2e
from torchao.quantization.pt2e.quantizer import x86_inductor_quantizer as x86

from common import FIXTURES, SIZE, SmallResNet, calibration, trained

torch.manual_seed(0)
model = trained(SmallResNet())
batch = {"x": {0: torch.export.Dim("batch", min=1, max=64)}}
captured = torch.export.export(model, (torch.randn(2, 3, SIZE, SIZE),), dynamic_shapes=batch).module()
quantizer = x86.X86InductorQuantizer().set_global(x86.get_default_x86_inductor_quantization_config(is_qat=True))
prepared = prepare_qat_pt2e(captured, quantizer)
allow_exported_model_train_eval(prepared)  # .train() / .eval() switch its batch norms, as on any module
with torch.no_grad():
    for x in calibration():
        prepared(x)
trained(prepared, steps=10, seed=1)  # QAT, ending in eval mode (its .eval() returns None here)
converted = convert_pt2e(prepared)
FIXTURES.mkdir(parents=True, exist_ok=True)
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    program = torch.onnx.export(converted, (torch.randn(2, 3, SIZE, SIZE),), dynamo=True, input_names=["input"],
                                dynamic_shapes=batch, verbose=False)
program.save(str(FIXTURES / "torchao-pt2e-small-resnet.onnx"))
print("wrote", FIXTURES / "torchao-pt2e-small-resnet.onnx")
