"""The converter thins heads as thin does: through each head's norm, GPT-J's rotation, a masked export, an int4 Llama;
loading a thinned checkpoint; a key-value cache."""

import warnings

import numpy as np
import pytest
import torch

from recal_torch import ScheduledModifierManager, ThinningWarning, load_thinned, thin

transformers = pytest.importorskip("transformers")
from tests.torch.transformer_models import (  # noqa: E402
    GPT2_FFN,
    GPT2_HEADS,
    LLAMA_FFN,
    LLAMA_HEADS,
    MODELS,
    PER_HEAD_PARAMS,
    _batch,
    _config,
    _gpt2,
    _llama,
    _Logits,
    _neox,
    _recipe,
    _train,
)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["qwen3", "olmo2"])
def test_the_converter_thins_heads_through_each_heads_norm_and_leaves_a_norm_of_all_heads(name, tmp_path):
    """Qwen3 normalizes each head's queries and keys (over the head's last axis): the converter follows the norm and
    removes a dead key/value head. OLMo 2 normalizes all heads' queries together, before they are split: removing a
    head would change the others, so the converter leaves the attention whole, and the conversion verifies."""
    from recal_onnx import quantize_qat_export
    from recal_torch import export_onnx
    from tests.support.torch_models import CausalLMLogits

    torch.manual_seed(0)
    model = _config(name)
    manager = ScheduledModifierManager.from_yaml("- !QuantizationModifier {start_epoch: 0, reduce_range: true}\n")
    optimizer = manager.modify(model, torch.optim.SGD(model.parameters(), lr=0.0), 1)
    ids = torch.randint(0, 128, (2, 8))
    model.train()
    model(input_ids=ids).logits.sum().backward()
    optimizer.step()
    manager.finalize()
    attention = model.model.layers[0].self_attn
    with torch.no_grad():  # the last key/value head's values (Qwen3: 2 of 4 query heads; OLMo 2: 1 of 4) are zero
        attention.v_proj.weight[-16:] = 0
    export_onnx(CausalLMLogits(model.eval()), ids, tmp_path / "masked.onnx", input_names=["ids"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = quantize_qat_export(tmp_path / "masked.onnx", tmp_path / "out.onnx", inputs={"ids": ids.numpy()})
    assert result.rewrites.get("thin_heads", 0) == (2 if name == "qwen3" else 0)
    assert result.verification.problem(None) is None, result.verification


@pytest.mark.slow
def test_the_converter_thins_gpt_j_through_its_rotation_of_channel_pairs(tmp_path):
    """GPT-J rotates each pair of a head's first channels (``stack(-x[..., 1::2], x[..., ::2], -1)`` flattened back,
    a reshape that holds the head count) before the heads are transposed, with cos and sin computed from the
    positions: the converter follows the heads through it, removes a dead head of an int8 QAT export, and the
    conversion verifies. (The TorchScript exporter cannot export GPT-J: ``aten::diff``.)"""
    from recal_onnx import quantize_qat_export
    from recal_torch import export_onnx
    from tests.support.torch_models import CausalLMLogits

    torch.manual_seed(0)
    model, ids = _config("gpt-j"), torch.randint(0, 128, (2, 8))
    manager = ScheduledModifierManager.from_yaml("- !QuantizationModifier {start_epoch: 0, reduce_range: true}\n")
    optimizer = manager.modify(model, torch.optim.SGD(model.parameters(), lr=0.0), 1)
    model.train()
    model(input_ids=ids).logits.sum().backward()
    optimizer.step()
    manager.finalize()
    with torch.no_grad():  # head 1's values are zero
        model.transformer.h[0].attn.v_proj.weight[16:32] = 0
    export_onnx(CausalLMLogits(model.eval()), ids, tmp_path / "masked.onnx", input_names=["ids"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        warnings.simplefilter("error", ThinningWarning)  # (the later filter comes first)
        result = quantize_qat_export(tmp_path / "masked.onnx", tmp_path / "out.onnx", inputs={"ids": ids.numpy()})
    assert result.rewrites.get("thin_heads", 0) == 1 and result.heads_kept == {}
    assert result.verification.problem(None) is None, result.verification


@pytest.mark.slow
@pytest.mark.parametrize("name,dynamo", [("bert", False), ("vit", True), ("bert", True), ("llama", False),
                                        ("llama", True), ("gpt2", False), ("gpt2", True), ("neox", True)],
                         ids=["bert-torchscript", "vit-dynamo", "bert-dynamo", "llama-torchscript", "llama-dynamo",
                              "gpt2-torchscript", "gpt2-dynamo", "neox-dynamo"])
def test_the_converter_thins_a_masked_export_as_thin_does(name, dynamo, tmp_path):
    import onnx
    import onnxruntime as ort

    from recal_onnx import UnconvertedOpsWarning, quantize_qat_export
    from recal_torch import export_onnx

    build, heads, ffn, units, ffn_width = {**MODELS, "gpt2": (_gpt2, GPT2_HEADS, GPT2_FFN, 4, 256), "neox": (
        _neox, PER_HEAD_PARAMS, r"['re:.*mlp\.dense_h_to_4h\.weight']", 4, 128)}[name]
    torch.manual_seed(0)
    model = build()
    recipe = _recipe(heads, ffn) + "- !QuantizationModifier {start_epoch: 2, reduce_range: true}\n"
    _train(name, model, recipe)
    inputs, _ = _batch(name, 7)
    keys = tuple(inputs)
    wrapped = _Logits(model.eval(), keys)
    example = tuple(v[:1] for v in inputs.values())
    export_onnx(wrapped, example, tmp_path / "masked.onnx", dynamo=dynamo, input_names=list(keys))
    with warnings.catch_warnings():  # LayerNorm and residual adds stay float (named in the warning): not tested here
        warnings.simplefilter("ignore", UnconvertedOpsWarning)
        thinned = quantize_qat_export(tmp_path / "masked.onnx", tmp_path / "thinned.onnx")
        quantize_qat_export(tmp_path / "masked.onnx", tmp_path / "dense.onnx", thin=False)
    assert thinned.rewrites["thin_heads"] == 4  # half the 4 heads of both layers (Llama: 1 of 2 key/value heads)
    assert thinned.rewrites["thin_channels"] == 2 * ffn_width // 2
    feeds = {k: v[:1].numpy() for k, v in inputs.items()}
    for options in (None, ort.SessionOptions()):
        if options is not None:
            options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        a = ort.InferenceSession(str(tmp_path / "thinned.onnx"), options).run(None, feeds)[0]
        b = ort.InferenceSession(str(tmp_path / "dense.onnx"), options).run(None, feeds)[0]
        np.testing.assert_allclose(a, b, atol=1e-5 * float(np.abs(b).max()))

    def int8_weights(path):  # the layers' integer weights, tables and all
        model = onnx.load(str(path))
        return sum(int(np.prod(t.dims)) for t in model.graph.initializer if t.data_type in (2, 3))

    dense_weights = int8_weights(tmp_path / "dense.onnx")
    # 2 layers: half the heads of Q, K, V and O, half the neurons of up and down, and their per-channel zero points
    h = 32 if name == "vit" else 64
    if name == "llama":  # K and V are h / 2 wide (2 key/value heads of 16); gate, up and down; rotary in the way
        removed = 2 * (2 * h * h // 2 + 2 * h * h // 4 + 3 * ffn_width // 2 * h + h // 2 + 2 * h // 4 + ffn_width)
    else:
        removed = 4 * h * h + 2 * ffn_width * h + 3 * h + ffn_width
    assert int8_weights(tmp_path / "thinned.onnx") == dense_weights - removed


def test_a_llama_pruned_thinned_and_int4_in_one_recipe_converts_and_reloads(tmp_path):
    """Heads (grouped-query: a unit is a key/value head with its query heads) and FFN neurons pruned, then W4A16
    QAT in groups of 32, in one recipe: the neurons are pruned in whole groups of the down projection's scales, so
    ``thin`` removes them and the dead heads, the thinned model computes what the masked one did, exports, converts
    to MatMulNBits verified, and ``load_thinned`` rebuilds it from the dense config."""
    from recal_onnx import quantize_qat_export
    from recal_torch import export_onnx, load_thinned
    from tests.support.torch_models import CausalLMLogits

    torch.manual_seed(0)
    model = _llama()
    recipe = _recipe(LLAMA_HEADS, LLAMA_FFN) + ("- !QuantizationModifier {start_epoch: 2, scheme: {input_activations: "
                                                "null, weights: {num_bits: 4, group_size: 32}}}\n")
    manager = ScheduledModifierManager.from_yaml(recipe)
    optimizer = manager.modify(model, torch.optim.AdamW(model.parameters(), lr=1e-3), steps_per_epoch=4)
    model.train()
    for step in range(12):
        inputs, labels = _batch("llama", step)
        optimizer.zero_grad()
        model(**inputs, labels=labels, use_cache=False).loss.backward()
        optimizer.step()
    manager.finalize()
    model.eval()
    ids = _batch("llama", 99)[0]["input_ids"]
    with torch.no_grad():
        masked = model(input_ids=ids, use_cache=False).logits
    report = thin(model)
    assert [(b, a) for _, b, a in report.heads] == [(4, 2), (4, 2)], str(report)
    # FFN neurons pruned in whole groups of the down projection's int4 scales (32): 2 of 3 blocks of 96, all thinned
    assert sorted((b, a) for _, b, a in report.spaces if a < b) == [(96, 32), (96, 32)], str(report)
    assert model.model.layers[0].mlp.down_proj.in_features == 32
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids, use_cache=False).logits, masked, atol=0, rtol=0)
    path = export_onnx(CausalLMLogits(model).eval(), ids, tmp_path / "thin.qat.onnx", input_names=["ids"],
                       dynamic_sequence=True)
    result = quantize_qat_export(str(path), tmp_path / "thin.int4.onnx", inputs={"ids": ids.numpy()})
    assert [n.op_type for n in result.model.graph.node].count("MatMulNBits") == 15
    assert result.verification.problem(None) is None and result.verification.max_abs_diff == 0
    rebuilt = _llama()
    load_thinned(rebuilt, {k: v for k, v in model.state_dict().items() if "fake_quant" not in k})
    assert rebuilt.model.layers[0].self_attn.q_proj.weight.shape == (32, 64)


def test_thinning_keeps_the_groups_of_a_weight_only_layer_whole():
    """A channel that shares an int4 group with a live one stays (its scales cover the whole group); channels that
    fill dead groups go; the thinned model computes what the masked one did."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    manager = ScheduledModifierManager.from_yaml(
        "- !QuantizationModifier {start_epoch: 0, scheme: {input_activations: null, weights: {num_bits: 4, "
        "group_size: 16}}}\n")
    optimizer = manager.modify(model, torch.optim.SGD(model.parameters(), lr=0.1), steps_per_epoch=1)
    x = torch.randn(16, 16)
    model(x).sum().backward()
    optimizer.step()
    manager.finalize(model)
    with torch.no_grad():
        dead = [*range(16), 20, 21]  # the whole first group, and two channels of the second
        model[0].weight[dead] = 0
        model[0].bias[dead] = 0
        masked = model(x)
    report = thin(model, x)
    assert report.spaces[0][1:] == (64, 48), str(report)  # the first group went; 20 and 21 stayed with their group
    assert model[2].in_features == 48 and model[2].weight_fake_quant.scale.shape == (4, 3)
    with torch.no_grad():
        torch.testing.assert_close(model(x), masked, atol=0, rtol=0)


def test_load_thinned_refuses_query_heads_that_do_not_divide_among_key_value_heads():
    """A grouped-query decoder (8 query heads, 4 key/value heads) given a state with 6 query heads: refused naming the
    attention layer, the model left as built (the first forward would fail inside attention, naming nothing)."""
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, vocab_size=100,
                                      num_attention_heads=8, num_key_value_heads=4)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    state = dict(model.state_dict())
    q, o = "model.layers.1.self_attn.q_proj.weight", "model.layers.1.self_attn.o_proj.weight"
    state[q], state[o] = state[q][:48], state[o][:, :48]
    with pytest.raises(ValueError, match=r"model\.layers\.1\.self_attn \(LlamaAttention\): 6 query heads do not "
                                         r"divide among 4 key/value heads"):
        load_thinned(model, state)
    assert model.model.layers[1].self_attn.q_proj.out_features == 64
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    state[q], state[o] = before[q][:32], before[o][:, :32]  # 4 query heads: one for each key/value head
    load_thinned(model, state)
    assert model.model.layers[1].self_attn.num_key_value_groups == 1
    model(torch.tensor([[1, 2, 3]]))


def test_a_default_llama_with_its_key_value_cache_thins_on_the_users_inputs():
    """``thin(model, example_inputs=(ids,))`` on a LlamaForCausalLM as users have it (``use_cache=True``): traced
    without the cache (no tensor torch.export can return), the dead MLP channels go, the outputs are the same."""
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, vocab_size=100,
                                      num_attention_heads=8, num_key_value_heads=4)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    assert model.config.use_cache
    mlp = model.model.layers[0].mlp
    with torch.no_grad():
        mlp.up_proj.weight[:10] = 0
        mlp.gate_proj.weight[:10] = 0
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        masked = model(ids).logits
    report = thin(model, example_inputs=(ids,))
    assert mlp.up_proj.out_features == 118 and "128 -> 118" in str(report)
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, masked, atol=1e-5, rtol=0)
