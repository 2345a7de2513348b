"""torchao's PT2E QAT flow at its documented x86 defaults on a transformer, into
tests/fixtures/interop/torchao-pt2e-small-bert.onnx.

The small BERT of ``common.py`` (Hugging Face ``BertForSequenceClassification`` from a config, byte tokens of the
standard library's source) is trained, captured by ``torch.export`` (token ids of batch 1 and 32 positions), prepared
by ``prepare_qat_pt2e`` with ``X86InductorQuantizer`` at ``get_default_x86_inductor_quantization_config(is_qat=True)``
(uint8 inputs and int8 per-channel weights of every Linear), calibrated, QAT-trained, converted by ``convert_pt2e`` and
exported by ``torch.onnx.export(dynamo=True)``: QuantizeLinear / DequantizeLinear. Run in the venv of
``torchao_pt2e_export.py`` with ``transformers`` added:

    /tmp/venv_nncf/bin/pip install transformers
    /tmp/venv_nncf/bin/python scripts/interop_exports/torchao_pt2e_bert_export.py
"""

import warnings

import torch
from torchao.quantization.pt2e import allow_exported_model_train_eval
from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_qat_pt2e
from torchao.quantization.pt2e.quantizer import x86_inductor_quantizer as x86

from common import FIXTURES, TOKENS, text_accuracy, text_batches, trained_bert, trained_on_text

model = trained_bert()
example = (torch.zeros(1, TOKENS, dtype=torch.long),)
captured = torch.export.export(model, example).module()
quantizer = x86.X86InductorQuantizer().set_global(x86.get_default_x86_inductor_quantization_config(is_qat=True))
prepared = prepare_qat_pt2e(captured, quantizer)
allow_exported_model_train_eval(prepared)  # .train() / .eval() switch its dropouts, as on any module
with torch.no_grad():
    for ids, _ in text_batches(8, batch=1, seed=1):  # the captured graph's shapes: batch 1
        prepared(ids)


class Batch1(torch.nn.Module):
    """The captured graph runs batch 1 alone: train it one window at a time, its gradients summed over a batch."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, ids):
        return torch.cat([self.inner(row[None]) for row in ids])


trained_on_text(Batch1(prepared), steps=30, seed=2, lr=1e-4)  # QAT
converted = convert_pt2e(prepared)
print("QAT accuracy", text_accuracy(Batch1(converted)))
FIXTURES.mkdir(parents=True, exist_ok=True)
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    program = torch.onnx.export(converted, example, dynamo=True, input_names=["input_ids"], output_names=["logits"],
                                verbose=False)
program.save(str(FIXTURES / "torchao-pt2e-small-bert.onnx"))
print("wrote", FIXTURES / "torchao-pt2e-small-bert.onnx")
