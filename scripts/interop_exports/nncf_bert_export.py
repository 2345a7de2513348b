"""NNCF's documented QAT flow for transformers at its defaults, into tests/fixtures/interop/nncf-small-bert.onnx.

The small BERT of ``common.py`` (Hugging Face ``BertForSequenceClassification`` from a config, byte tokens of the
standard library's source) is trained, quantized by ``nncf.quantize(..., model_type=nncf.ModelType.TRANSFORMER)``
(NNCF's transformer preset: symmetric int8 weights per channel, activations calibrated on real batches, attention
matmuls included), fine-tuned (QAT), stripped with ``nncf.strip`` (torch's own fake-quantize ops) and exported by
``torch.onnx.export`` (TorchScript path; token ids of batch 1 and 32 positions): QuantizeLinear/DequantizeLinear.
Run in the venv of ``nncf_export.py`` with ``transformers`` added:

    /tmp/venv_nncf/bin/pip install transformers
    /tmp/venv_nncf/bin/python scripts/interop_exports/nncf_bert_export.py
"""

import nncf
import torch

from common import TOKENS, export_text_model, text_accuracy, text_batches, trained_bert, trained_on_text

model = trained_bert()
calibration = nncf.Dataset([ids for ids, _ in text_batches(8, seed=1)])
quantized = nncf.quantize(model, calibration, model_type=nncf.ModelType.TRANSFORMER)
quantized = trained_on_text(quantized, steps=30, seed=2, lr=1e-4)  # QAT
print("QAT accuracy", text_accuracy(quantized))
stripped = nncf.strip(quantized, example_input=torch.zeros(1, TOKENS, dtype=torch.long))
export_text_model(stripped, "nncf-small-bert.onnx", opset=13)
