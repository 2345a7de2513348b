"""AIMET's documented QAT flow at its defaults on a transformer, into tests/fixtures/interop/aimet-small-bert.onnx
(and by its classic ``sim.export``, the float model and its encodings, into aimet-sim-small-bert.onnx and
aimet-sim-small-bert.encodings, checked against the simulation: ``common.check_aimet_reading``).

The small BERT of ``common.py`` (Hugging Face ``BertForSequenceClassification`` from a config, byte tokens of the
standard library's source) is trained, wrapped in ``QuantizationSimModel`` (8-bit weights and activations, AIMET's
default config: the outputs of its ops quantized too, softmax and layer norms among them;
``training_range_learning_with_tf_init``), calibrated by ``compute_encodings``, QAT-trained and exported by
``aimet_torch.onnx.export`` (QuantizeLinear / DequantizeLinear, int32 biases, opset 21, TorchScript path; token ids
of batch 1 and 32 positions). Run in the venv of ``aimet_export.py`` with ``transformers`` added:

    /tmp/venv_aimet/bin/pip install transformers
    /tmp/venv_aimet/bin/python scripts/interop_exports/aimet_bert_export.py
"""

import warnings

import torch
import transformers.models.llama.modeling_llama  # noqa: F401  before the stand-in: transformers probes torchvision

from common import (FIXTURES, TOKENS, export_aimet_classic, stand_in_torchvision, text_accuracy, text_batches,
                    trained_bert, trained_on_text)

stand_in_torchvision()

import aimet_torch.onnx  # noqa: E402
from aimet_torch.common.defs import QuantScheme  # noqa: E402
from aimet_torch.quantsim import QuantizationSimModel  # noqa: E402

model = trained_bert()
example = torch.zeros(1, TOKENS, dtype=torch.long)
sim = QuantizationSimModel(model, example, quant_scheme=QuantScheme.training_range_learning_with_tf_init,
                           default_output_bw=8, default_param_bw=8)
sim.compute_encodings(lambda m: [m(ids) for ids, _ in text_batches(8, seed=1)])
trained_on_text(sim.model, steps=30, seed=2, lr=1e-4)  # QAT, ranges learned
print("QAT accuracy", text_accuracy(sim.model))
FIXTURES.mkdir(parents=True, exist_ok=True)
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    aimet_torch.onnx.export(sim.model, example, str(FIXTURES / "aimet-small-bert.onnx"), input_names=["input_ids"],
                            output_names=["logits"], opset_version=21, dynamo=False, export_int32_bias=True)
print("wrote", FIXTURES / "aimet-small-bert.onnx")
export_aimet_classic(sim, example, FIXTURES / "aimet-sim-small-bert.onnx",
                     [ids[i:i + 1] for ids, _ in text_batches(2, seed=7) for i in range(16)])

