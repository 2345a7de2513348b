"""Hugging Face decoders (small configs, random weights, nothing downloaded): GPT-2 (transformers' Conv1D, learned
positions, tied LM head) and Llama (Linear, rotary positions, RMSNorm, SiLU MLP), each in int4 (W4A16, groups of 32:
every projection and the head a MatMulNBits, the embedding tables int4 too) and in int8 (W8A8 with reduce_range: integer matmuls). Exported with no
KV cache for any batch and length; the converted model equals the QAT export in a default and an unoptimized
onnxruntime session, at another length than it was exported at."""

import numpy as np
import onnxruntime as ort
import pytest
import torch

from recal_onnx import quantize_qat_export
from recal_torch import ScheduledModifierManager, export_onnx

from tests.support.torch_models import CausalLMLogits

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.slow

VOCAB = 320
SCHEMES = {
    "int4": "{start_epoch: 0, scheme: {input_activations: null, weights: {num_bits: 4, group_size: 32}}, "
            "scheme_overrides: {Embedding: {input_activations: null, weights: {num_bits: 4, group_size: 32}}}}",
    "int8": "{start_epoch: 0, reduce_range: true}",
}


def gpt2():
    config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=64, n_embd=64, n_layer=2, n_head=2)
    return transformers.GPT2LMHeadModel(config), 9, 2  # 4 Conv1D a layer and the tied head; tokens, positions


def llama():
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
    return transformers.LlamaForCausalLM(config), 15, 1  # q, k, v, o, gate, up, down a layer and the head


@pytest.mark.parametrize("scheme", ["int4", "int8"])
@pytest.mark.parametrize("build", [gpt2, llama], ids=["gpt2", "llama"])
def test_decoder_trains_exports_and_converts(build, scheme, tmp_path):
    torch.manual_seed(0)
    model, layers, tables = build()
    manager = ScheduledModifierManager.from_yaml(f"- !QuantizationModifier {SCHEMES[scheme]}\n")
    optimizer = manager.modify(model, torch.optim.AdamW(model.parameters(), 1e-3), steps_per_epoch=3)
    g = torch.Generator().manual_seed(0)
    model.train()
    for _ in range(3):
        ids = torch.randint(0, VOCAB, (4, 24), generator=g)
        optimizer.zero_grad()
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        optimizer.step()
    manager.finalize(model)
    sample = torch.randint(0, VOCAB, (2, 24), generator=g)
    qat = export_onnx(CausalLMLogits(model).eval(), sample, tmp_path / "qat.onnx", input_names=["ids"],
                      dynamic_sequence=True)
    result = quantize_qat_export(str(qat), tmp_path / "int.onnx", inputs={"ids": sample.numpy()})
    kinds = [n.op_type for n in result.model.graph.node]
    integer = kinds.count("MatMulNBits") if scheme == "int4" else kinds.count("MatMulIntegerToFloat") + kinds.count(
        "QGemm")
    assert integer == layers, sorted(set(kinds))
    if scheme == "int4":  # the tables int4 too, gathered packed
        assert kinds.count("GatherBlockQuantized") == tables
    assert result.verification.max_abs_diff <= (1e-4 if scheme == "int4" else 0.02) * result.verification.output_range
    ids = torch.randint(0, VOCAB, (3, 11), generator=g).numpy()  # another batch and length
    reference = ort.InferenceSession(str(qat), providers=["CPUExecutionProvider"])
    expected = reference.run(None, {"ids": ids})[0]
    for level in (None, ort.GraphOptimizationLevel.ORT_DISABLE_ALL):
        options = ort.SessionOptions()
        if level is not None:
            options.graph_optimization_level = level
        got = ort.InferenceSession(str(tmp_path / "int.onnx"), options,
                                   providers=["CPUExecutionProvider"]).run(None, {"ids": ids})[0]
        assert got.shape == (3, 11, VOCAB)
        bound = (1e-4 if scheme == "int4" else 0.05) * float(np.ptp(expected))
        assert np.abs(got - expected).max() <= bound
