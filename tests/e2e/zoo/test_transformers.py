"""Hugging Face BERT and ViT (small configs, random weights, nothing downloaded): prune 80% + QAT under a
recipe, export with both exporters, convert to both formats; every Linear integer, embedding tables int8,
fidelity against the QAT export run as float QDQ, the result loads in onnxruntime at its default level."""

import collections
import warnings

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from recal_onnx import quantize_qat_export
from recal_onnx import UnconvertedOpsWarning
from recal_torch import ScheduledModifierManager, export_onnx
from recal_torch.qat import QATLinear

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.slow

RECIPE = """
- !EpochRangeModifier {start_epoch: 0, end_epoch: 2}
- !GMPruningModifier {params: %s, init_sparsity: 0.5, final_sparsity: 0.8, start_epoch: 0, end_epoch: 1,
                      update_frequency: 0.25}
- !QuantizationModifier {start_epoch: 1}
"""
SPE = 4
CLASSES = 3
# What stays float by design: LayerNorm, the residual stream's adds, the CLS token's select (ViT: also the
# patch + class token concat and position add); attention and GELU run in float between integer matmuls.
FLOAT_ALLOWED = {"LayerNormalization", "Add", "Gather", "Concat"}


class Bert(nn.Module):
    def __init__(self):
        super().__init__()
        config = transformers.BertConfig(vocab_size=800, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                                         intermediate_size=128, max_position_embeddings=32, num_labels=CLASSES)
        self.model = transformers.BertForSequenceClassification(config)

    def forward(self, ids, mask):
        return self.model(input_ids=ids, attention_mask=mask).logits

    @staticmethod
    def batch(g):
        ids = torch.randint(0, 800, (8, 16), generator=g)
        return (ids, torch.ones_like(ids)), ids[:, 1] % CLASSES

    tables = 3  # word, position, token type
    params = "['re:.*(query|key|value|dense)\\.weight$', model.bert.embeddings.word_embeddings.weight]"
    names = ("ids", "mask")


class ViT(nn.Module):
    def __init__(self):
        super().__init__()
        config = transformers.ViTConfig(image_size=32, patch_size=8, hidden_size=64, num_hidden_layers=2,
                                        num_attention_heads=2, intermediate_size=128, num_labels=CLASSES)
        self.model = transformers.ViTForImageClassification(config)

    def forward(self, x):
        return self.model(pixel_values=x).logits

    @staticmethod
    def batch(g):
        x = torch.randn(8, 3, 32, 32, generator=g)
        return (x,), (x[:, 0, :8, :8].mean((1, 2)) > 0).long()

    tables = 0
    params = "__ALL_PRUNABLE__"
    names = ("input",)


class Roberta(Bert):
    """RoBERTa: BERT with another embedding layout (positions from the padding index on)."""

    def __init__(self):
        nn.Module.__init__(self)
        config = transformers.RobertaConfig(vocab_size=800, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                                            intermediate_size=128, max_position_embeddings=40, num_labels=CLASSES)
        self.model = transformers.RobertaForSequenceClassification(config)

    params = "['re:.*(query|key|value|dense)\\.weight$']"


class DeiT(ViT):
    """DeiT: ViT with a distillation token beside the class token."""

    def __init__(self):
        nn.Module.__init__(self)
        config = transformers.DeiTConfig(image_size=32, patch_size=8, hidden_size=64, num_hidden_layers=2,
                                         num_attention_heads=2, intermediate_size=128, num_labels=CLASSES)
        self.model = transformers.DeiTForImageClassification(config)


class Swin(ViT):
    """Swin: shifted windows (a window partition whose Reshape the dynamo exporter fixes to a batch-1 sample)."""

    def __init__(self):
        nn.Module.__init__(self)
        config = transformers.SwinConfig(image_size=32, patch_size=4, embed_dim=16, depths=[1, 1], num_heads=[2, 2],
                                         window_size=4, num_labels=CLASSES)
        self.model = transformers.SwinForImageClassification(config)


class ShiftedSwin(Swin):
    """Swin with a shifted-window block (two blocks on an 8x8 patch grid, windows of 4): its attention mask."""

    def __init__(self):
        nn.Module.__init__(self)
        config = transformers.SwinConfig(image_size=32, patch_size=4, embed_dim=16, depths=[2], num_heads=[2],
                                         window_size=4, num_labels=CLASSES)
        self.model = transformers.SwinForImageClassification(config)


def _prune_and_qat(kind, quantized_attention: str | None = None):
    """``kind``'s model after the recipe's 80% pruning and QAT steps on synthetic data, finalized; its manager.
    ``quantized_attention``: the attention implementation ("sdpa", "eager") whose matmuls QAT quantizes too."""
    torch.manual_seed(0)
    model = kind()
    if quantized_attention is not None:
        model.model.config._attn_implementation = quantized_attention
    optimizer = torch.optim.Adam(model.parameters(), 1e-3)
    manager = ScheduledModifierManager.from_yaml(RECIPE % kind.params)
    manager.modify(model, optimizer, steps_per_epoch=SPE, quantize_attention=quantized_attention is not None)
    g = torch.Generator().manual_seed(0)
    model.train()
    for _ in range(2 * SPE):
        inputs, labels = kind.batch(g)
        optimizer.zero_grad()
        F.cross_entropy(model(*inputs), labels).backward()
        optimizer.step()
    manager.finalize(model)
    return model.eval(), manager


@pytest.fixture(scope="module", params=[Bert, ViT], ids=["bert", "vit"])
def qat_model(request):
    return _prune_and_qat(request.param)[0], request.param


def _linears(model):
    return sum(isinstance(m, QATLinear) for m in model.modules())


@pytest.mark.parametrize("dynamo", [True, False], ids=["dynamo", "torchscript"])
def test_transformer_quantizes_end_to_end(qat_model, dynamo, tmp_path):
    model, kind = qat_model
    linears = _linears(model)
    assert linears == sum(1 for m in model.modules() if isinstance(m, (QATLinear, nn.Linear)))
    sample = kind.batch(torch.Generator().manual_seed(1))[0]
    path = export_onnx(model, tuple(t[:2] for t in sample), tmp_path / "qat.onnx", dynamo=dynamo,
                       input_names=kind.names)
    for fmt in ("qoperator", "qdq"):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", UnconvertedOpsWarning)
            result = quantize_qat_export(str(path), tmp_path / f"{fmt}.onnx", format=fmt, min_agreement=0.999)
        left = {op for op, _ in result.float_nodes}
        assert left <= FLOAT_ALLOWED, left
        assert all(op in str(w.message) for w in caught for op in left)  # named, never silent
        v = result.verification
        assert v.samples >= 256 and v.argmax_agreement >= 0.999
        assert v.max_abs_diff <= 0.02 * v.output_range, v
        m = result.model
        kinds = collections.Counter(n.op_type for n in m.graph.node)
        integer = {t.name for t in m.graph.initializer if t.data_type in (onnx.TensorProto.INT8, onnx.TensorProto.UINT8)}
        gathered = sum(n.op_type == "Gather" and n.input[0] in integer for n in m.graph.node)
        assert gathered == kind.tables
        floats = [t for t in m.graph.initializer if t.data_type == onnx.TensorProto.FLOAT and np.prod(t.dims) >= 4096]
        assert not floats, [t.name for t in floats]  # every weight matrix and table is stored in int8
        if fmt == "qoperator":
            assert kinds["MatMulIntegerToFloat"] + kinds["QGemm"] == linears, kinds
            assert "MatMul" not in kinds or all(n.input[1] not in integer for n in m.graph.node if n.op_type == "MatMul")
        else:
            _assert_runtime_fuses_every_weight(m, tmp_path)


def _assert_runtime_fuses_every_weight(model: onnx.ModelProto, tmp_path) -> None:
    """onnxruntime at its default level turns every dequantized weight's matmul / conv into an integer kernel."""
    options = ort.SessionOptions()
    options.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    optimized = onnx.load(str(tmp_path / "optimized.onnx"))
    producers = {o: n for n in optimized.graph.node for o in n.output}
    for node in optimized.graph.node:
        if node.op_type in ("MatMul", "Gemm", "Conv", "FusedMatMul", "FusedConv", "FusedGemm"):
            for name in node.input[1:2]:
                source = producers.get(name)
                assert source is None or source.op_type != "DequantizeLinear", (node.op_type, node.name)
            assert name not in {t.name for t in optimized.graph.initializer}, (node.op_type, node.name)


def test_a_transformer_with_external_data_converts_and_its_input_is_untouched(qat_model, tmp_path, monkeypatch):
    """A model over 2 GB is stored as external data: exported so (dynamo), converted so, the input unchanged."""
    import hashlib

    import recal_onnx.save as save
    import recal_torch.export.to_onnx as export

    model, kind = qat_model
    monkeypatch.setattr(export, "EXTERNAL_DATA_BYTES", 1)  # pretend the model is above protobuf's limit
    sample = tuple(t[:2] for t in kind.batch(torch.Generator().manual_seed(1))[0])
    src = export_onnx(model, sample, tmp_path / "big.onnx", input_names=kind.names)
    inputs = sorted(p for p in tmp_path.iterdir())
    assert len(inputs) == 2, inputs  # the model and its data file
    digests = {p: hashlib.sha256(p.read_bytes()).hexdigest() for p in inputs}
    monkeypatch.setattr(save, "EXTERNAL_DATA_BYTES", 1)
    feeds = {k: v.numpy() for k, v in zip(kind.names, kind.batch(torch.Generator().manual_seed(2))[0])}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UnconvertedOpsWarning)  # ViT's float LayerNorms: the test above names them
        result = quantize_qat_export(src, tmp_path / "out.onnx", verify_inputs=feeds)
    assert (tmp_path / "out.onnx.data").is_file() and result.verification.samples == 8
    assert {p: hashlib.sha256(p.read_bytes()).hexdigest() for p in inputs} == digests
    got = ort.InferenceSession(str(result.path), providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    assert got.shape == (8, CLASSES)


@pytest.mark.parametrize("kind, attention", [(Bert, "sdpa"), (Bert, "eager"), (ViT, "sdpa")],
                         ids=["bert-sdpa", "bert-eager", "vit-sdpa"])
def test_attention_matmuls_quantize_as_an_option(kind, attention, tmp_path):
    model, manager = _prune_and_qat(kind, quantized_attention=attention)
    attended = [n for n, d in manager.quantized_layers.items() if d.startswith("attention matmuls")]
    assert len(attended) == 2  # one per layer
    sample = tuple(t[:2] for t in kind.batch(torch.Generator().manual_seed(1))[0])
    path = export_onnx(model.eval(), sample, tmp_path / "qat.onnx", input_names=kind.names)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UnconvertedOpsWarning)
        result = quantize_qat_export(str(path), tmp_path / "int8.onnx", min_agreement=0.999)
    kinds = collections.Counter(n.op_type for n in result.model.graph.node)
    assert "MatMul" not in kinds and kinds["MatMulIntegerToFloat"] + kinds["QGemm"] == _linears(model) + 4, kinds
    assert result.verification.max_abs_diff <= 0.02 * result.verification.output_range, result.verification


# Swin also moves its float residual stream through window partitions and patch merging (data movement only)
LIBRARY_FLOAT = {"roberta": FLOAT_ALLOWED, "deit": FLOAT_ALLOWED,
                 "swin": FLOAT_ALLOWED | {"Reshape", "Transpose", "Slice", "Pad"}}


@pytest.mark.parametrize("kind", [Roberta, DeiT, Swin], ids=["roberta", "deit", "swin"])
def test_more_hugging_face_models_quantize_from_a_batch_1_sample(kind, tmp_path):
    """RoBERTa, DeiT and Swin from small configs, exported as users do (a batch-1 sample, torch's default exporter)
    and with TorchScript, converted to both formats: every Linear integer (onnxruntime fuses every weight of the
    qdq form), what stays float named, argmax >= 0.999 on 256 inputs and logits within 2% of their range. Swin's dynamo export fixes its
    window partition to batch 1; export_onnx finds it at export and uses TorchScript, saying so."""
    from recal_torch import ExportWarning

    model, _ = _prune_and_qat(kind)
    sample = tuple(t[:1] for t in kind.batch(torch.Generator().manual_seed(1))[0])
    with warnings.catch_warnings(record=True) as exported:
        warnings.simplefilter("always", ExportWarning)
        path = export_onnx(model, sample, tmp_path / "qat.onnx", input_names=kind.names)
    fell_back = [w for w in exported if issubclass(w.category, ExportWarning)]
    assert bool(fell_back) == (kind is Swin), [str(w.message) for w in fell_back]
    torchscript = export_onnx(model, sample, tmp_path / "qat-ts.onnx", dynamo=False, input_names=kind.names)
    for source in (path, torchscript):
        for fmt in ("qoperator", "qdq"):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UnconvertedOpsWarning)
                result = quantize_qat_export(str(source), tmp_path / f"{fmt}.onnx", format=fmt, min_agreement=0.999)
            assert {op for op, _ in result.float_nodes} <= LIBRARY_FLOAT[kind.__name__.lower()], result.float_nodes
            v = result.verification
            assert v.samples >= 256 and v.argmax_agreement >= 0.999 and v.max_abs_diff <= 0.02 * v.output_range, v
            if fmt == "qoperator":
                kinds = collections.Counter(n.op_type for n in result.model.graph.node)
                assert kinds["MatMulIntegerToFloat"] + kinds["QGemm"] == _linears(model), kinds
            else:
                _assert_runtime_fuses_every_weight(result.model, tmp_path)


def test_swins_shifted_window_mask_leaves_exact_zeros_not_denormals(tmp_path):
    """Swin masks its shifted windows' attention with -100: in float (attention QAT off, the default) each masked
    probability is exp(-100), a float32 denormal that Intel CPUs compute slowly. The conversion masks with -10000
    instead (exact zeros), says so, and verifies against the export as written."""
    model, _ = _prune_and_qat(ShiftedSwin)
    sample = tuple(t[:1] for t in ShiftedSwin.batch(torch.Generator().manual_seed(1))[0])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", torch.jit.TracerWarning)  # transformers' shape checks, fixed at export
        path = export_onnx(model, sample, tmp_path / "qat.onnx", dynamo=False, input_names=ShiftedSwin.names)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UnconvertedOpsWarning)
        result = quantize_qat_export(str(path), tmp_path / "int8.onnx")
    assert list(result.masked_scores.values()) == [-100.0] and "-10000" in result.masked_scores_note
    tiny = np.finfo(np.float32).tiny
    for model_path, denormals in ((path, True), (tmp_path / "int8.onnx", False)):
        probabilities = _softmax_outputs(onnx.load(model_path), sample[0].numpy(), tmp_path)
        assert any(((p != 0) & (p < tiny)).any() for p in probabilities) == denormals, model_path
    v = result.verification
    assert v.samples >= 256 and v.argmax_agreement == 1.0 and v.local_steps <= 1, v


def _softmax_outputs(model, x, tmp_path):
    """Every Softmax's output of ``model`` on ``x`` (onnxruntime, optimizations off)."""
    names = [n.output[0] for n in model.graph.node if n.op_type == "Softmax"]
    model.graph.output.extend(onnx.helper.make_empty_tensor_value_info(name) for name in names)
    onnx.save(model, tmp_path / "probabilities.onnx")
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(str(tmp_path / "probabilities.onnx"), options, providers=["CPUExecutionProvider"])
    return session.run(names, {session.get_inputs()[0].name: x})

