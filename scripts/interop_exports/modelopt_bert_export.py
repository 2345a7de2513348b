"""NVIDIA ModelOpt's documented QAT flow at its defaults on a transformer, into
tests/fixtures/interop/modelopt-small-bert.onnx.

The small BERT of ``common.py`` (Hugging Face ``BertForSequenceClassification`` from a config, byte tokens of the
standard library's source) is trained, quantized by ``mtq.quantize`` with ``mtq.INT8_DEFAULT_CFG`` (int8 per-channel
weights and int8 per-tensor inputs of every Linear, calibrated by a forward loop), fine-tuned (QAT) and exported by
``torch.onnx.export`` (TorchScript path; token ids of batch 1 and 32 positions). Run in the venv of
``modelopt_export.py`` with ``transformers`` added:

    /tmp/venv_mo/bin/pip install transformers
    /tmp/venv_mo/bin/python scripts/interop_exports/modelopt_bert_export.py
"""

import modelopt.torch.quantization as mtq
import torch

from common import export_text_model, text_accuracy, text_batches, trained_bert, trained_on_text

model = trained_bert()


def forward_loop(m):
    with torch.no_grad():
        for ids, _ in text_batches(8, seed=1):
            m(ids)


quantized = trained_on_text(mtq.quantize(model, mtq.INT8_DEFAULT_CFG, forward_loop), steps=30, seed=2,
                            lr=1e-4)  # QAT
print("QAT accuracy", text_accuracy(quantized))
export_text_model(quantized, "modelopt-small-bert.onnx", opset=17)
