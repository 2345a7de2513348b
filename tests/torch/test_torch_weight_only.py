"""Weight-only QAT (W4A16, W8A16): int4 / int8 weights per group or channel, float activations, MatMulNBits in ONNX."""

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from torch import nn

from recal_core import RecipeError
from recal_onnx import quantize_qat_export
from recal_onnx.verify import verify_models
from recal_torch import ScheduledModifierManager, export_onnx
from recal_torch.qat import GroupWeightFakeQuantize, QATConv
from recal_torch.qat import QATEmbedding, QATLinear, WeightOnlyLinear

from tests.torch.test_torch_transformer_qat import TOKENS, VOCAB, TinyEncoder, _data, _train
from tests.support.torch_models import assert_same_state, load_checkpoint

W4_GROUP16 = "{input_activations: null, weights: {num_bits: 4, strategy: group, group_size: 16}}"


def _fresh(recipe: str, seed: int):
    """A TinyEncoder seeded ``seed`` under ``recipe`` with Adam: (model, manager, optimizer)."""
    torch.manual_seed(seed)
    model = TinyEncoder()
    manager = ScheduledModifierManager.from_yaml(recipe)
    return model, manager, manager.modify(model, torch.optim.Adam(model.parameters(), 1e-3), steps_per_epoch=4)


def _manager(scheme: str, overrides: str = "null", model=None):
    model = model or TinyEncoder()
    manager = ScheduledModifierManager.from_yaml(
        f"- !QuantizationModifier\n  start_epoch: 0\n  scheme: {scheme}\n  scheme_overrides: {overrides}\n")
    optimizer = manager.modify(model, torch.optim.Adam(model.parameters(), 1e-3), steps_per_epoch=4)
    return model, manager, optimizer


def test_group_fake_quantize_grid_and_the_mse_observer():
    """Every group of 16 inputs gets its own scale; the integers stay within +-7; the mse observer's clipping never
    quantizes a weight with more squared error than minmax's."""
    torch.manual_seed(0)
    w = torch.randn(8, 64) * torch.linspace(0.1, 3, 64)  # groups of very different ranges
    w[0, 5] = 20.0  # an outlier: minmax spends its levels on it
    errors = {}
    for observer in ("minmax", "mse"):
        fq = GroupWeightFakeQuantize(8, 64, bits=4, group_size=16, observer=observer)
        out = fq(w)
        q = fq.integers(w)
        assert fq.scale.shape == (8, 4) and int(q.abs().max()) <= 7
        np.testing.assert_allclose(out, (q.float().reshape(-1, 16) * fq.scale.reshape(-1, 1)).reshape(8, 64),
                                   rtol=1e-6, atol=1e-6)
        errors[observer] = float(((out - w) ** 2).sum())
    assert errors["mse"] < errors["minmax"]
    with pytest.raises(ValueError, match="groups of 16"):
        GroupWeightFakeQuantize(8, 40, bits=4, group_size=16)


@pytest.mark.parametrize("dynamo", [True, False], ids=["dynamo", "torchscript"])
def test_w4a16_trains_exports_and_runs_as_matmulnbits(tmp_path, dynamo):
    """Every Linear weight-only int4 in groups of 16, the table int8 per row: the converted model runs each Linear as
    MatMulNBits and equals the QAT model in a default and an unoptimized onnxruntime session."""
    torch.manual_seed(0)
    model, manager, optimizer = _manager(W4_GROUP16)
    linears = [n for n, m in model.named_modules() if isinstance(m, WeightOnlyLinear)]
    assert len(linears) == 8 and isinstance(model.emb, QATEmbedding)
    assert not any(isinstance(m, QATLinear) for m in model.modules())
    assert manager.quantized_layers["q"].endswith("int4 symmetric per group of 16 (minmax), weight-only (input and "
                                                  "output float)")
    _train(model, optimizer, _data())
    assert model.q.weight_fake_quant.scale.shape == (16, 1)  # 16 inputs: one group
    manager.finalize(model)
    ids = torch.randint(0, VOCAB, (4, TOKENS))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    path = export_onnx(model.eval(), ids, tmp_path / "w4.onnx", input_names=["ids"], dynamo=dynamo)
    # the export's copy shares the swapped layers' weights (read, not copied): the model is not changed
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    result = quantize_qat_export(str(path), tmp_path / "w4_int.onnx", inputs={"ids": ids.numpy()})
    kinds = [n.op_type for n in result.model.graph.node]
    assert kinds.count("MatMulNBits") == 8 and kinds.count("MatMul") == 2 and "Gemm" not in kinds  # Q·Kᵀ, P·V
    bits = {a.i for n in result.model.graph.node if n.op_type == "MatMulNBits" for a in n.attribute if a.name == "bits"}
    assert bits == {4}
    # the dynamo exporter's per-node record (module paths, stack traces) is not carried into the integer model
    records = [p.key for n in result.model.graph.node for p in n.metadata_props if p.key.startswith("pkg.torch.onnx.")]
    assert not records and (result.rewrites["drop_exporter_metadata"] > 1000) == dynamo
    if dynamo:
        kept = quantize_qat_export(str(path), inputs={"ids": ids.numpy()}, keep_exporter_metadata=True)
        assert any(p.key == "pkg.torch.onnx.stack_trace" for n in kept.model.graph.node for p in n.metadata_props)
    with torch.no_grad():
        expected = model(ids).numpy()
    for level in (None, ort.GraphOptimizationLevel.ORT_DISABLE_ALL):
        options = ort.SessionOptions()
        if level is not None:
            options.graph_optimization_level = level
        session = ort.InferenceSession(str(tmp_path / "w4_int.onnx"), options, providers=["CPUExecutionProvider"])
        got = session.run(None, {"ids": ids.numpy()})[0]
        np.testing.assert_allclose(got, expected, atol=1e-5 * max(1.0, float(np.ptp(expected))))
    assert result.verification.outputs[0].share == 1e-4  # float on both sides: compared at float precision
    # the same model with each row's block scales in the wrong places (what reading a blocked DequantizeLinear as
    # per channel wrote): refused, though far within the 10% of range that integer rounding needs
    wrong = onnx.ModelProto()
    wrong.CopyFrom(result.model)
    scales = {n.input[2] for n in wrong.graph.node if n.op_type == "MatMulNBits"}
    for tensor in wrong.graph.initializer:
        if tensor.name in scales:
            values = onnx.numpy_helper.to_array(tensor)
            tensor.CopyFrom(onnx.numpy_helper.from_array(np.roll(values, 1), tensor.name))
    verdict = verify_models(str(path), wrong, {"ids": ids.numpy()})
    assert verdict.max_abs_diff < 0.1 * verdict.output_range and "max abs difference" in verdict.problem(None)


def test_weight_only_beside_w8a8_layers(tmp_path):
    """W8A8 by default, the head weight-only int8 per channel (W8A16): the head runs as an 8-bit MatMulNBits on its
    float input, the other Linears as integer matmuls."""
    torch.manual_seed(0)
    model, manager, optimizer = _manager("W8A8", "{head: {input_activations: null, weights: {num_bits: 8}}}")
    assert isinstance(model.head, WeightOnlyLinear) and isinstance(model.proj, QATLinear)
    assert "int8 symmetric per channel" in manager.quantized_layers["head"]
    _train(model, optimizer, _data())
    manager.finalize(model)
    ids = torch.randint(0, VOCAB, (4, TOKENS))
    path = export_onnx(model.eval(), ids, tmp_path / "mixed.onnx", input_names=["ids"])
    result = quantize_qat_export(str(path), inputs={"ids": ids.numpy()})
    nbits = [n for n in result.model.graph.node if n.op_type == "MatMulNBits"]
    assert len(nbits) == 1 and {a.name: a.i for a in nbits[0].attribute}["bits"] == 8
    assert sum(n.op_type in ("MatMulIntegerToFloat", "QGemm") for n in result.model.graph.node) >= 6
    assert result.verification.max_abs_diff <= 0.02 * result.verification.output_range


def test_what_weight_only_cannot_do_is_a_located_error():
    with pytest.raises(RecipeError, match=r"<string>:3:\d+: .*'scheme'.*4-bit or per-group weights are weight-only"):
        _manager("{weights: {num_bits: 4, group_size: 16}}")  # W4A8: activations quantized
    with pytest.raises(RecipeError, match=r"'scheme'.*group_size 32 does not divide the inputs of .*(16 inputs)"):
        _manager("{input_activations: null, weights: {num_bits: 4, group_size: 32}}")
    conv = nn.Sequential(nn.Conv2d(1, 4, 3), nn.Flatten(), nn.Linear(16, 2))
    with pytest.raises(RecipeError, match=r"'scheme'.*weight-only, which recal does for Linear layers, not for 0"):
        _manager("W8A16", model=conv)
    conv = nn.Sequential(nn.Conv2d(1, 4, 3), nn.Flatten(), nn.Linear(16, 2))
    _manager("W8A16", "{Conv2d: {}}", model=conv)  # the conv W8A8 by its override, the Linear weight-only
    assert isinstance(conv[2], WeightOnlyLinear) and isinstance(conv[0], QATConv)


def test_tensorflow_refuses_a_scheme_it_cannot_run():
    from recal_core.recipe import load_recipe
    from recal_keras.recipe_support import qat_problems

    recipe = load_recipe("- !QuantizationModifier {start_epoch: 0, scheme: W4A16}\n")
    problems = qat_problems(recipe.bind(10), "in TensorFlow")
    assert len(problems) == 1 and "scheme W4A16 is not available in TensorFlow" in str(problems[0])


def test_the_int4_decoder_example_runs(tmp_path):
    """scripts/examples/int4_decoder.py, as a user copies it, on a few steps: both files written, every Linear of
    the Llama (seven a layer, and the head) a MatMulNBits."""
    from tests.support.paths import ROOT
    from tests.support.forked import run_program

    out = tmp_path / "lm.onnx"
    result = run_program(str(ROOT / "scripts/examples/int4_decoder.py"), "--steps", "3", "--output", str(out))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "15 MatMulNBits" in result.stdout and out.exists() and out.with_suffix(".qat.onnx").exists()
    assert "test perplexity" in result.stdout


def test_resume_mid_weight_only_qat_is_bit_identical():
    """Weight-only QAT starting at epoch 1 of 3 (steps_per_epoch 4), a checkpoint at step 6: a fresh model and
    optimizer loading it (optimizer first: recal re-creates the weight-only layers) train on to the same weights,
    scales and LR."""
    import copy

    recipe = ("- !QuantizationModifier {start_epoch: 1, scheme: " + W4_GROUP16 + "}\n"
              "- !LearningRateFunctionModifier {start_epoch: 0, end_epoch: 3, lr_func: cosine, init_lr: 0.01, "
              "final_lr: 0.001}\n")
    data = _data(12)

    model_a, _, opt_a = _fresh(recipe, 0)
    ckpt = {}
    _train(model_a, opt_a, data, after_step=lambda k: ckpt.update(copy.deepcopy(
        {"model": model_a.state_dict(), "optimizer": opt_a.state_dict()})) if k == 6 else None)
    model_b, _, opt_b = _fresh(recipe, 1)
    load_checkpoint(model_b, opt_b, ckpt)
    assert isinstance(model_b.q, WeightOnlyLinear)
    _train(model_b, opt_b, data[6:])
    assert_same_state(model_a, model_b)
    assert opt_a.param_groups[0]["lr"] == opt_b.param_groups[0]["lr"]


def test_an_int4_table_is_gathered_packed(tmp_path):
    """scheme_overrides makes the embedding table int4 in groups of 16: QAT reads it on that grid, the converted model
    gathers it with GatherBlockQuantized (half an int8 table's bytes) and equals the QAT model."""
    from recal_torch.qat import WeightOnlyEmbedding

    torch.manual_seed(0)
    model, manager, optimizer = _manager(W4_GROUP16, "{Embedding: " + W4_GROUP16 + "}")
    assert isinstance(model.emb, WeightOnlyEmbedding)
    assert manager.quantized_layers["emb"] == "Embedding, table (60, 16) int4 symmetric per group of 16 (minmax), rows float"
    _train(model, optimizer, _data())
    manager.finalize(model)
    ids = torch.randint(0, VOCAB, (4, TOKENS))
    path = export_onnx(model.eval(), ids, tmp_path / "t.onnx", input_names=["ids"])
    result = quantize_qat_export(str(path), inputs={"ids": ids.numpy()})
    kinds = [n.op_type for n in result.model.graph.node]
    assert kinds.count("GatherBlockQuantized") == 1 and kinds.count("MatMulNBits") == 8 and "Gather" not in kinds
    assert result.verification.max_abs_diff <= 1e-5 * max(1.0, result.verification.output_range)
    with pytest.raises(RecipeError, match=r"'Embedding' \(emb\).*other than symmetric 8 or 4 bits per row or per"):
        _manager(W4_GROUP16, "{Embedding: {input_activations: null, weights: {num_bits: 4, symmetric: false}}}")
    with pytest.raises(RecipeError, match=r"'Embedding' \(emb\).*other than symmetric 8 or 4 bits per row or per"):
        _manager(W4_GROUP16, "{Embedding: {input_activations: null, weights: {num_bits: 2, group_size: 16}}}")


def test_ternary_weights_train_export_and_run_as_2bit_matmulnbits(tmp_path):
    """``num_bits: 2`` on the feed-forward layers (ternary: -1, 0, 1 times a scale per group), int4 elsewhere: the mse
    observer finds a scale no worse than minmax's, and the converted model runs those layers as 2-bit MatMulNBits,
    equal to the QAT model; W2A8 is refused like W4A8."""
    torch.manual_seed(0)
    w = torch.randn(8, 64)
    errors = {}
    for observer in ("minmax", "mse"):
        fq = GroupWeightFakeQuantize(8, 64, bits=2, group_size=16, observer=observer)
        assert set(fq.integers(w).unique().tolist()) <= {-1, 0, 1}
        errors[observer] = float(((fq(w) - w) ** 2).sum())
    assert errors["mse"] < 0.7 * errors["minmax"]  # a ternary grid's best threshold is far below max|w|
    w2 = "{input_activations: null, weights: {num_bits: 2, group_size: 16, observer: mse}}"
    model, manager, optimizer = _manager(W4_GROUP16, f"{{up: {w2}, down: {w2}}}")
    ternary = [n for n, d in manager.quantized_layers.items() if "int2 symmetric per group of 16 (mse)" in d]
    assert ternary == ["up", "down"]
    _train(model, optimizer, _data())
    manager.finalize(model)
    ids = torch.randint(0, VOCAB, (4, TOKENS))
    path = export_onnx(model.eval(), ids, tmp_path / "w2.onnx", input_names=["ids"])
    result = quantize_qat_export(str(path), tmp_path / "w2_int.onnx", inputs={"ids": ids.numpy()})
    bits = [next(a.i for a in n.attribute if a.name == "bits") for n in result.model.graph.node
            if n.op_type == "MatMulNBits"]
    assert sorted(bits) == sorted([2] * len(ternary) + [4] * (8 - len(ternary)))
    with torch.no_grad():
        expected = model(ids).numpy()
    for level in (None, ort.GraphOptimizationLevel.ORT_DISABLE_ALL):
        options = ort.SessionOptions()
        options.graph_optimization_level = level if level is not None else options.graph_optimization_level
        got = ort.InferenceSession(str(tmp_path / "w2_int.onnx"), options,
                                   providers=["CPUExecutionProvider"]).run(None, {"ids": ids.numpy()})[0]
        np.testing.assert_allclose(got, expected, atol=1e-5 * max(1.0, float(np.ptp(expected))))
    assert result.verification.max_abs_diff <= 1e-5 * max(1.0, result.verification.output_range)
    with pytest.raises(RecipeError, match=r"'scheme'.*4-bit or per-group weights are weight-only"):
        _manager("{weights: {num_bits: 2}}")


W4_LSQ = ("{input_activations: null, weights: {num_bits: 4, strategy: group, group_size: 16, observer: lsq, "
          "observer_kwargs: {lr_factor: 0.5}}}")


def test_learned_scales_train_in_their_own_param_group_freeze_resume_and_export(tmp_path):
    """``observer: lsq``: each weight-only layer's group scales start at the mse fit and then train (LSQ's scaled
    gradient) in a param group of their own at half the first group's LR, following the recipe's LR schedule; they
    stop when the observers freeze; a run resumed mid-way (optimizer first) ends on the same weights, scales and
    LRs; the export converts to MatMulNBits holding the learned scales, verified."""
    import copy

    recipe = ("- !QuantizationModifier {start_epoch: 1, disable_quantization_observer_epoch: 2.5, scheme: "
              + W4_LSQ + "}\n- !LearningRateFunctionModifier {start_epoch: 0, end_epoch: 3, lr_func: cosine, "
              "init_lr: 0.01, final_lr: 0.001}\n")
    data = _data(12)

    model_a, manager_a, opt_a = _fresh(recipe, 0)
    seen, ckpt = {}, {}

    def after(k):
        scale = model_a.q.weight_fake_quant.scale if isinstance(model_a.q, WeightOnlyLinear) else None
        seen[k] = None if scale is None else (scale.detach().clone(), [g["lr"] for g in opt_a.param_groups])
        if k == 6:
            ckpt.update(copy.deepcopy({"model": model_a.state_dict(), "optimizer": opt_a.state_dict()}))

    _train(model_a, opt_a, data, after_step=after)
    assert seen[3] is None and len(opt_a.param_groups) == 2  # QAT from step 4: the scales' group appears then
    scales = opt_a.param_groups[1]["params"]
    assert len(scales) == 8 and any(s is model_a.q.weight_fake_quant.scale for s in scales)
    for k in (5, 8):
        first, group = seen[k][1]
        assert group == pytest.approx(0.5 * first)  # half the first group's LR, as the cosine moves it
    assert not torch.equal(seen[5][0], seen[8][0])  # learned between steps 5 and 8
    assert torch.equal(seen[10][0], seen[12][0]) and not model_a.q.weight_fake_quant.scale.requires_grad  # frozen
    model_b, _, opt_b = _fresh(recipe, 1)
    load_checkpoint(model_b, opt_b, ckpt)
    _train(model_b, opt_b, data[6:])
    assert_same_state(model_a, model_b)
    assert [g["lr"] for g in opt_a.param_groups] == [g["lr"] for g in opt_b.param_groups]
    manager_a.finalize(model_a)
    ids = torch.randint(0, VOCAB, (4, TOKENS))
    path = export_onnx(model_a.eval(), ids, tmp_path / "lsq.onnx", input_names=["ids"])
    result = quantize_qat_export(str(path), tmp_path / "lsq_int.onnx", inputs={"ids": ids.numpy()})
    assert [n.op_type for n in result.model.graph.node].count("MatMulNBits") == 8
    assert result.verification.problem(None) is None
    with torch.no_grad():
        expected = model_a(ids).numpy()
    got = ort.InferenceSession(str(tmp_path / "lsq_int.onnx"), providers=["CPUExecutionProvider"]).run(
        None, {"ids": ids.numpy()})[0]
    np.testing.assert_allclose(got, expected, atol=1e-5 * max(1.0, float(np.ptp(expected))))


def test_what_learned_scales_cannot_do_is_a_located_error():
    with pytest.raises(RecipeError, match=r"'scheme'.*an lsq observer on output activations"):
        _manager("{weights: {observer: lsq}, output_activations: {symmetric: false, observer: lsq}}")
    with pytest.raises(RecipeError, match=r"observer_kwargs go with observer: lsq"):
        _manager("{input_activations: null, weights: {num_bits: 4, group_size: 16, observer_kwargs: "
                 "{lr_factor: 2}}}")
    from recal_core.recipe import load_recipe
    from recal_keras.recipe_support import qat_problems

    recipe = load_recipe("- !QuantizationModifier {start_epoch: 0, scheme: " + W4_LSQ + "}\n")
    assert qat_problems(recipe.bind(10), "in TensorFlow")
    recipe = load_recipe("- !QuantizationModifier {start_epoch: 0, scheme: {weights: {observer: lsq}}}\n")
    (problem,) = qat_problems(recipe.bind(10), "in TensorFlow")
    assert "learned scales (observer: lsq) are not available in TensorFlow yet" in str(problem)
