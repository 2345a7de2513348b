"""Brevitas's documented flow for models ``torch.fx`` cannot trace, on a transformer, into
tests/fixtures/interop/brevitas-small-bert.onnx (and the same model by ``export_qonnx``, QONNX's ``Quant`` nodes,
into brevitas-qonnx-small-bert.onnx).

The small BERT of ``common.py`` (Hugging Face ``BertForSequenceClassification`` from a config, byte tokens of the
standard library's source) is trained, quantized layer by layer by ``layerwise_quantize`` (Brevitas's mode for
models graph mode cannot trace, Hugging Face's among them: every Linear with 8-bit weights and inputs), calibrated
(``calibration_mode``), QAT-trained and exported with ``export_onnx_qcdq`` (QuantizeLinear, Clip, DequantizeLinear)
by its TorchScript path (token ids of batch 1 and 32 positions). Run in the venv of ``brevitas_export.py`` with
``transformers`` added:

    /tmp/venv_brevitas/bin/pip install transformers
    /tmp/venv_brevitas/bin/python scripts/interop_exports/brevitas_bert_export.py
"""

import torch
from brevitas.export import export_onnx_qcdq, export_qonnx
from brevitas.graph.calibrate import calibration_mode
from brevitas.graph.quantize import layerwise_quantize

from common import FIXTURES, TOKENS, text_accuracy, text_batches, trained_bert, trained_on_text

model = trained_bert()
quant = layerwise_quantize(model)
with torch.no_grad(), calibration_mode(quant):
    for ids, _ in text_batches(8, seed=1):
        quant(ids)
quant = trained_on_text(quant, steps=30, seed=2, lr=1e-4)  # QAT
print("QAT accuracy", text_accuracy(quant))
FIXTURES.mkdir(parents=True, exist_ok=True)
export_onnx_qcdq(quant, args=torch.zeros(1, TOKENS, dtype=torch.long), opset_version=13, dynamo=False,
                 export_path=str(FIXTURES / "brevitas-small-bert.onnx"), input_names=["input_ids"],
                 output_names=["logits"])
print("wrote", FIXTURES / "brevitas-small-bert.onnx")
export_qonnx(quant, args=torch.zeros(1, TOKENS, dtype=torch.long), opset_version=13, dynamo=False,
             export_path=str(FIXTURES / "brevitas-qonnx-small-bert.onnx"), input_names=["input_ids"],
             output_names=["logits"])
print("wrote", FIXTURES / "brevitas-qonnx-small-bert.onnx")
