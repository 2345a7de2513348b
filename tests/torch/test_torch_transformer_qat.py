"""QAT for transformer-style models: Linears on 3-D inputs, int8 embedding tables, planning without torch.fx."""

import logging

import numpy as np
import onnx
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from recal_onnx import quantize_qat_export
from recal_torch import ScheduledModifierManager, export_onnx
from recal_torch.model_params import describe_parameters
from recal_torch.qat import QATEmbedding, QATLinear, QATTorchLinear, fake_quantize_model

from tests.support.torch_models import CausalLMLogits

VOCAB, TOKENS, CLASSES = 60, 6, 3


class TinyEncoder(nn.Module):
    """Embedding, self-attention, a GELU MLP, residual adds, a LayerNorm under a branch on the input's shape
    (torch.fx cannot trace it, as it cannot trace Hugging Face models) and a two-Linear head."""

    def __init__(self, d: int = 16):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, d)
        self.norm = nn.LayerNorm(d)
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))
        self.up, self.down = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)
        self.proj, self.head = nn.Linear(d, d), nn.Linear(d, CLASSES)

    def forward(self, ids):
        h = self.emb(ids)
        if ids.dim() == 2:  # a branch on the input: both exporters follow it, torch.fx cannot
            h = self.norm(h)
        att = torch.softmax(self.q(h) @ self.k(h).transpose(-1, -2) / 4.0, dim=-1) @ self.v(h)
        h = h + self.o(att)
        h = h + self.down(F.gelu(self.up(h)))
        return self.head(self.proj(h.mean(1)))  # the head reads the projection's output as it is


def _data(steps=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (steps, 16, TOKENS), generator=g)
    return [(x, (x[:, 0] % CLASSES)) for x in ids]  # learnable: the first token's id decides the class


def _train(model, optimizer, data, after_step=None):
    model.train()
    for k, (x, y) in enumerate(data):
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
        if after_step:
            after_step(k + 1)


def test_a_model_fx_cannot_trace_is_planned_from_its_first_forward(caplog):
    torch.manual_seed(0)
    model = TinyEncoder()
    with caplog.at_level(logging.INFO, logger="recal_torch.qat.plan"):
        created = fake_quantize_model(model)
        keys = set(model.state_dict())
        assert {type(m) for m in created} == {QATEmbedding, QATTorchLinear} and len(created) == 9
        assert all(m.input_fake_quant.active and m.activation_post_process.active for m in created
                   if isinstance(m, QATLinear))  # before any forward: everything quantized
        model.train()
        model(_data(1)[0][0])
    assert "torch.fx cannot trace TinyEncoder" in caplog.text and "made from its first forward" in caplog.text
    assert "8 layers (0 with BatchNorm folded), 7 inputs and 1 outputs quantized" in caplog.text
    assert not model.head.input_fake_quant.active and model.proj.activation_post_process.active
    for name in ("q", "k", "v", "o", "up", "down", "proj"):
        layer = getattr(model, name)
        assert layer.input_fake_quant.active
        assert layer.activation_post_process.active == (name == "proj")
    assert set(model.state_dict()) == keys  # the plan is in buffers: checkpoints keep their keys
    fresh = TinyEncoder()
    fake_quantize_model(fresh)
    fresh.load_state_dict(model.state_dict())
    assert not fresh.head.input_fake_quant.active and not fresh.q.activation_post_process.active
    # q, k and v read one tensor: their observers hold the same range, so the int8 model quantizes it once
    assert float(model.q.input_fake_quant.scale) == float(model.k.input_fake_quant.scale)


def test_embedding_tables_are_quantized_per_row_and_pruned_only_when_named():
    torch.manual_seed(0)
    recipe = """
- !EpochRangeModifier {start_epoch: 0, end_epoch: 2}
- !GMPruningModifier {params: %s, init_sparsity: 0.5, final_sparsity: 0.8, start_epoch: 0, end_epoch: 1,
                      update_frequency: 0.5}
- !QuantizationModifier {start_epoch: 1}
"""
    for params, table_pruned in (("__ALL_PRUNABLE__", False), ("[emb.weight, re:.*(up|down).weight]", True)):
        model = TinyEncoder()
        optimizer = torch.optim.Adam(model.parameters(), 1e-2)
        manager = ScheduledModifierManager.from_yaml(recipe % params)
        manager.modify(model, optimizer, steps_per_epoch=4)
        _train(model, optimizer, _data(8))
        manager.finalize(model)
        assert isinstance(model.emb, QATEmbedding)
        zeros = float((model.emb.weight == 0).float().mean())
        assert zeros == (pytest.approx(0.8, abs=0.01) if table_pruned else 0.0)
        q = model.emb.weight_fake_quant(model.emb.weight).detach()
        scale = model.emb.weight_fake_quant.scale  # one scale per row: each row's largest value is +-127 steps
        assert scale.shape == (VOCAB,)
        steps = (q / scale[:, None]).numpy()
        np.testing.assert_allclose(steps, np.rint(steps), atol=2e-2)
        peaks = np.abs(steps).max(1)
        peaks = peaks[peaks > 0]  # (a row pruned whole has nothing to scale)
        assert np.all(np.abs(peaks - 127) <= 1.01)  # frozen scales: the last step may move a peak below 127
        assert np.abs(steps).max() <= 127.01  # and never past it: export writes +-127


@pytest.mark.parametrize("dynamo", [True, False])
def test_every_linear_and_the_table_are_integer_after_conversion(tmp_path, dynamo):
    torch.manual_seed(0)
    model = TinyEncoder()
    optimizer = torch.optim.Adam(model.parameters(), 1e-2)
    manager = ScheduledModifierManager.from_yaml("""
- !EpochRangeModifier {start_epoch: 0, end_epoch: 2}
- !GMPruningModifier {params: ['re:^(emb|q|k|v|o|up|down|proj|head)\\.weight$'], init_sparsity: 0.5, final_sparsity: 0.8,
                      start_epoch: 0, end_epoch: 1, update_frequency: 0.5}
- !QuantizationModifier {start_epoch: 1}
""")
    manager.modify(model, optimizer, steps_per_epoch=8)
    _train(model, optimizer, _data(16))
    manager.finalize(model)
    model.eval()
    path = export_onnx(model, _data(1)[0][0][:2], tmp_path / "qat.onnx", dynamo=dynamo, input_names=["ids"])
    for fmt in ("qoperator", "qdq"):
        result = quantize_qat_export(str(path), tmp_path / f"{fmt}.onnx", format=fmt, min_agreement=0.99)
        m = result.model
        kinds = [n.op_type for n in m.graph.node]
        int8 = {t.name: t for t in m.graph.initializer if t.data_type in (onnx.TensorProto.INT8,
                                                                         onnx.TensorProto.UINT8)}
        table = next(n for n in m.graph.node if n.op_type == "Gather" and n.input[0] in int8)
        assert list(int8[table.input[0]].dims) == [VOCAB, 16]
        assert not any(t.data_type == onnx.TensorProto.FLOAT and list(t.dims) == [VOCAB, 16] for t in m.graph.initializer)
        if fmt == "qoperator":
            # every Linear integer: QGemm (3-D inputs flattened around it), or MatMulIntegerToFloat where a float
            # bias lies off its int32 grid (a row pruned whole: its weight scale is tiny)
            assert kinds.count("QGemm") + kinds.count("MatMulIntegerToFloat") == 8, kinds
            assert kinds.count("QGemm") >= 5, kinds
            assert "Transpose" not in [n.op_type for n in m.graph.node if n.input[0] in int8]
        else:  # every weight DQ reads int8 (no float weight left), and onnxruntime loads it at its default level
            assert sum(k == "DequantizeLinear" for k in kinds) >= 8
        assert result.verification.argmax_agreement >= 0.99 and result.verification.samples >= 256
        assert result.verification.max_abs_diff <= 0.05 * result.verification.output_range, result.verification


def test_the_manager_reports_what_it_quantized():
    torch.manual_seed(0)
    model = TinyEncoder()
    optimizer = torch.optim.SGD(model.parameters(), 0.01)
    manager = ScheduledModifierManager.from_yaml("- !QuantizationModifier {start_epoch: 0}\n")
    manager.modify(model, optimizer, steps_per_epoch=2)
    _train(model, optimizer, _data(2))
    layers = manager.quantized_layers
    assert set(layers) == {"emb", "q", "k", "v", "o", "up", "down", "proj", "head"}
    assert layers["emb"] == "Embedding, table (60, 16) int8 per row, rows float"
    assert layers["head"] == "Linear, weight (3, 16) int8 per channel, input from a quantized layer, output float"
    assert layers["proj"].endswith("input uint8, output uint8") and layers["q"].endswith("input uint8, output float")
    # the QAT modules keep their layers' pruning rules: a table is still pruned only when named
    infos = {p.name: p for p in describe_parameters(model)[0]}
    assert not infos["emb.weight"].prunable and infos["emb.weight"].prunable_when_named
    assert infos["q.weight"].prunable and not infos["q.weight"].prunable_when_named


@pytest.mark.parametrize("dynamo", [True, False])
def test_attention_matmuls_quantized_as_an_option(tmp_path, dynamo):
    torch.manual_seed(0)
    model = TinyEncoder()
    optimizer = torch.optim.Adam(model.parameters(), 1e-2)
    manager = ScheduledModifierManager.from_yaml("- !QuantizationModifier {start_epoch: 0}\n")
    manager.modify(model, optimizer, steps_per_epoch=8, quantize_attention=True)
    _train(model, optimizer, _data(8))
    manager.finalize(model)
    assert manager.quantized_layers[""] == "attention matmuls Q·Kᵀ and P·V, operands uint8"
    fq = model.attention_fake_quant
    assert all(getattr(fq, slot).has_observed for slot in ("query", "key", "probs", "value"))
    assert float(fq.probs.min_val) >= 0 and float(fq.probs.max_val) <= 1  # softmax probabilities
    path = export_onnx(model.eval(), _data(1)[0][0][:2], tmp_path / "qat.onnx", dynamo=dynamo, input_names=["ids"])
    result = quantize_qat_export(str(path), tmp_path / "int8.onnx", min_agreement=0.99)
    kinds = [n.op_type for n in result.model.graph.node]
    # 8 Linears (QGemm, 3-D inputs flattened); Q·Kᵀ (read by float ops: MatMulIntegerToFloat) and P·V (its output
    # quantized for the output projection: QLinearMatMul)
    assert kinds.count("QGemm") == 8 and kinds.count("QLinearMatMul") == 1 and "MatMul" not in kinds, kinds
    assert kinds.count("MatMulIntegerToFloat") == 1, kinds
    assert result.verification.max_abs_diff <= 0.05 * result.verification.output_range


def test_the_result_names_what_computes_in_float(tmp_path, caplog):
    torch.manual_seed(0)
    model = TinyEncoder()
    optimizer = torch.optim.Adam(model.parameters(), 1e-2)
    manager = ScheduledModifierManager.from_yaml("- !QuantizationModifier {start_epoch: 0}\n")
    manager.modify(model, optimizer, steps_per_epoch=8)
    _train(model, optimizer, _data(8))
    manager.finalize(model)
    path = export_onnx(model.eval(), _data(1)[0][0][:2], tmp_path / "qat.onnx", dynamo=False, input_names=["ids"])
    with caplog.at_level(logging.INFO, logger="recal_onnx.convert"):
        result = quantize_qat_export(str(path))
    ops = result.float_ops
    assert ops["MatMul"] == 2 and ops["Softmax"] == 1 and ops["LayerNormalization"] == 1  # attention, by design
    assert "MatMulIntegerToFloat" not in ops and "QGemm" not in ops
    assert "computing in float" in caplog.text and "Softmax x1" in caplog.text


def test_an_attention_forward_that_raises_leaves_no_mode_behind():
    from recal_torch.qat import quantize_attention

    class Failing(TinyEncoder):
        def forward(self, ids):
            raise RuntimeError("boom")

    model = Failing()
    assert quantize_attention(model) == [""]
    depth = torch._C._len_torch_function_stack()
    with pytest.raises(RuntimeError, match="boom"):
        model(_data(1)[0][0])
    assert torch._C._len_torch_function_stack() == depth


@pytest.mark.slow
def test_gpt2s_conv1d_layers_are_pruned_quantized_and_integer_in_onnx(tmp_path):
    """GPT-2 (and its forks) build every projection from transformers' Conv1D, a Linear with its weight stored
    [in, out]: __ALL_PRUNABLE__ selects them, QAT quantizes each (per output channel, the same Parameter read
    transposed), and the int8 model runs every one as an integer GEMM beside the tied LM head."""
    transformers = pytest.importorskip("transformers")

    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=300, n_positions=32, n_embd=32, n_layer=2, n_head=2,
                                     bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(config)
    manager = ScheduledModifierManager.from_yaml(
        "- !GMPruningModifier {params: __ALL_PRUNABLE__, init_sparsity: 0.5, final_sparsity: 0.8, start_epoch: 0,"
        " end_epoch: 1, update_frequency: 0.5}\n- !QuantizationModifier {start_epoch: 0, reduce_range: true}\n")
    optimizer = manager.modify(model, torch.optim.Adam(model.parameters(), 1e-3), steps_per_epoch=2)
    conv1d = [n for n, m in model.named_modules() if isinstance(m, QATLinear) and m.transposed]
    assert len(conv1d) == 8 and set(manager.masks.masks) == {f"{n}.weight" for n in conv1d}
    g = torch.Generator().manual_seed(0)
    model.train()
    for _ in range(4):
        ids = torch.randint(0, 300, (4, 16), generator=g)
        optimizer.zero_grad()
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
    manager.finalize(model)
    weight = model.transformer.h[0].attn.c_attn.weight
    assert weight.shape == (32, 96) and abs(float((weight == 0).float().mean()) - 0.8) < 0.01

    path = export_onnx(CausalLMLogits(model).eval(), torch.randint(0, 300, (2, 16)), tmp_path / "qat.onnx", input_names=["ids"])
    result = quantize_qat_export(str(path))
    kinds = [n.op_type for n in result.model.graph.node]
    assert kinds.count("MatMulIntegerToFloat") + kinds.count("QGemm") == 9  # eight Conv1D and the LM head
    assert result.verification.max_abs_diff <= 0.02 * result.verification.output_range, result.verification
