"""Head and FFN-neuron pruning of Hugging Face transformers (BERT, ViT, Llama with grouped-query attention),
and thinning: exact counts per layer, the four projections of a head pruned together, and a thinned model
that computes what the masked one did."""

import copy
import warnings

import numpy as np
import pytest
import torch

from recal_core import RecipeError
from recal_core.channel_coupling import CouplingError
from recal_core.head_coupling import Attention, head_groups, head_layout, live_heads, unit_rows
from recal_torch import ScheduledModifierManager, ThinningWarning, load_thinned, thin

transformers = pytest.importorskip("transformers")

BERT_HEADS = r"['re:.*attention\.self\.(query|key|value)\.weight', 're:.*attention\.output\.dense\.weight']"
BERT_FFN = r"['re:.*intermediate\.dense\.weight']"
LLAMA_HEADS = r"['re:.*self_attn\.[qkvo]_proj\.weight']"
LLAMA_FFN = r"['re:.*mlp\.(gate|up)_proj\.weight']"
VIT_HEADS = r"['re:.*attention\.[qkvo]_proj\.weight']"
VIT_FFN = r"['re:.*mlp\.fc1\.weight']"


def _bert():
    config = transformers.BertConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=96, vocab_size=120, num_labels=3,
                                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return transformers.BertForSequenceClassification(config)


def _llama():
    config = transformers.LlamaConfig(vocab_size=120, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2)
    return transformers.LlamaForCausalLM(config)


def _vit():
    config = transformers.ViTConfig(image_size=8, patch_size=2, num_channels=1, hidden_size=32, num_hidden_layers=2,
                                    num_attention_heads=4, intermediate_size=64, num_labels=10)
    return transformers.ViTForImageClassification(config)


def _batch(name, seed):
    g = torch.Generator().manual_seed(seed)
    if name == "vit":
        return {"pixel_values": torch.randn(4, 1, 8, 8, generator=g)}, torch.randint(0, 10, (4,), generator=g)
    ids = torch.randint(0, 120, (4, 10), generator=g)
    mask = torch.ones(4, 10, dtype=torch.long)
    mask[1, 7:] = 0  # padding: the attention mask goes through the thinned heads too
    labels = torch.randint(0, 3, (4,), generator=g) if name == "bert" else ids
    return {"input_ids": ids, "attention_mask": mask}, labels


MODELS = {"bert": (_bert, BERT_HEADS, BERT_FFN, 4, 96), "llama": (_llama, LLAMA_HEADS, LLAMA_FFN, 2, 96),
          "vit": (_vit, VIT_HEADS, VIT_FFN, 4, 64)}


def _recipe(heads, ffn, head_sparsity=0.5, ffn_sparsity=0.5):
    return f"""
- !EpochRangeModifier {{start_epoch: 0, end_epoch: 3}}
- !GradualKSModifier {{params: {heads}, init_sparsity: 0.0, final_sparsity: {head_sparsity}, start_epoch: 0,
                      end_epoch: 2, update_frequency: 1, mask_type: head}}
- !GradualKSModifier {{params: {ffn}, init_sparsity: 0.0, final_sparsity: {ffn_sparsity}, start_epoch: 0,
                      end_epoch: 2, update_frequency: 1, mask_type: filter}}
"""


def _train(name, model, recipe, steps=12):
    manager = ScheduledModifierManager.from_yaml(recipe)
    optimizer = manager.modify(model, torch.optim.AdamW(model.parameters(), lr=1e-3), steps_per_epoch=4)
    model.train()
    for step in range(steps):
        inputs, labels = _batch(name, step)
        loss = model(**inputs, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    manager.finalize()
    return manager


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(MODELS))
def test_heads_and_ffn_neurons_pruned_exactly_then_thinned_to_the_same_outputs(name):
    build, heads, ffn, units, ffn_width = MODELS[name]
    torch.manual_seed(0)
    model = build()
    _train(name, model, _recipe(heads, ffn))
    params = dict(model.named_parameters())
    for layer in range(2):
        attention = [n for n in params if f"layers.{layer}." in n or f"layer.{layer}." in n]
        q = next(params[n] for n in attention if n.endswith(("query.weight", "q_proj.weight")))
        v = next(params[n] for n in attention if n.endswith(("value.weight", "v_proj.weight")))
        dead_v = (v.reshape(units, -1) == 0).all(1)
        assert int(dead_v.sum()) == units // 2, "exactly half the key/value units pruned per layer"
        dead_q = (q.reshape(units, -1) == 0).all(1)
        assert torch.equal(dead_q, dead_v), "a unit's query rows go with its value rows"
        up = next(params[n] for n in attention if n.endswith(("intermediate.dense.weight", "up_proj.weight",
                                                              "fc1.weight")))
        assert int((up == 0).all(1).sum()) == ffn_width // 2
    model.eval()
    inputs, _ = _batch(name, 99)
    with torch.no_grad():
        masked = model(**inputs).logits
    before = sum(p.numel() for p in model.parameters())
    report = thin(model)
    assert report.removed > 0 and "heads" in str(report)
    with torch.no_grad():
        thinned = model(**inputs).logits
    assert sum(p.numel() for p in model.parameters()) < 0.8 * before
    torch.testing.assert_close(thinned, masked, atol=1e-5 * float(masked.abs().max()), rtol=0)
    # saved, it loads into a model built dense from the same config, head counts and all
    torch.manual_seed(1)
    fresh = build()
    load_thinned(fresh, copy.deepcopy(model.state_dict()))
    with torch.no_grad():
        torch.testing.assert_close(fresh.eval()(**inputs).logits, thinned, atol=0, rtol=0)
    assert [getattr(m, "num_attention_heads", None) for m in fresh.modules()] == \
        [getattr(m, "num_attention_heads", None) for m in model.modules()]
    fresh(**inputs).logits.sum().backward()  # and trains on


def test_the_head_count_per_layer_follows_thinning_and_save_pretrained_round_trips(tmp_path):
    from safetensors.torch import load_file

    torch.manual_seed(0)
    model = _bert()
    _train("bert", model, _recipe(BERT_HEADS, BERT_FFN, head_sparsity=0.25, ffn_sparsity=0.0))
    thin(model)
    for layer in model.bert.encoder.layer:
        assert layer.attention.self.num_attention_heads == 3
        assert layer.attention.self.query.out_features == 3 * 16
        assert layer.attention.output.dense.in_features == 3 * 16
    model.save_pretrained(tmp_path)
    fresh = transformers.BertForSequenceClassification(transformers.BertConfig.from_pretrained(tmp_path))
    load_thinned(fresh, load_file(tmp_path / "model.safetensors"))
    inputs, _ = _batch("bert", 5)
    with torch.no_grad():
        torch.testing.assert_close(fresh.eval()(**inputs).logits, model.eval()(**inputs).logits, atol=0, rtol=0)
    assert fresh.bert.encoder.layer[1].attention.self.num_attention_heads == 3


class _UserWrapper(torch.nn.Module):
    """A user's own wrapper around a Hugging Face classifier: positional inputs in, logits out."""

    def __init__(self, bert=None):
        super().__init__()
        self.bert = bert if bert is not None else _bert()

    def forward(self, ids, mask):
        return self.bert(input_ids=ids, attention_mask=mask).logits


@pytest.mark.parametrize("wrapped, qat_start", [(True, 0), (False, 2)], ids=["wrapped-qat-throughout",
                                                                             "hf-qat-after-pruning"])
def test_one_recipe_prunes_heads_and_neurons_with_qat_then_thins_and_converts(tmp_path, wrapped, qat_start):
    """Head pruning, FFN neuron pruning and QAT in one recipe, QAT from the start or after the pruning: the
    inputs given to ``modify`` serve ``thin`` (not given again), the QAT layers trace, the thinned model computes
    what the masked one did (1e-5 of the logits' range), and its export converts to int8, verified."""
    import numpy as np

    from recal_onnx import quantize_qat_export
    from recal_torch import export_onnx

    torch.manual_seed(0)
    model = _UserWrapper() if wrapped else _bert()
    recipe = _recipe(BERT_HEADS, BERT_FFN) + f"- !QuantizationModifier {{start_epoch: {qat_start}}}\n"
    manager = ScheduledModifierManager.from_yaml(recipe)
    first, _ = _batch("bert", 0)
    ids, mask = first["input_ids"], first["attention_mask"]
    example = (ids, mask) if wrapped else ((), {"input_ids": ids, "attention_mask": mask})
    optimizer = manager.modify(model, torch.optim.AdamW(model.parameters(), lr=1e-3), steps_per_epoch=4,
                               example_inputs=example)
    model.train()
    for step in range(12):
        inputs, labels = _batch("bert", step)
        logits = model(inputs["input_ids"], inputs["attention_mask"]) if wrapped else model(**inputs).logits
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(logits, labels).backward()
        optimizer.step()
    manager.finalize()
    model.eval()
    inputs, _ = _batch("bert", 99)
    args = (inputs["input_ids"], inputs["attention_mask"])

    def logits():
        with torch.no_grad():
            return model(*args) if wrapped else model(**inputs).logits

    masked = logits()
    report = thin(model)  # no inputs: those given to modify
    assert len(report.heads) == 2 and len(report.spaces) >= 2, str(report)
    torch.testing.assert_close(logits(), masked, atol=1e-5 * float(masked.max() - masked.min()), rtol=0)
    exported = model if wrapped else _UserWrapper(model)  # the HF model exported as users wrap it for ONNX: logits out
    path = export_onnx(exported, args, tmp_path / "thinned.qat.onnx", dynamo=False, input_names=["ids", "mask"])
    feeds = {"ids": np.random.default_rng(0).integers(0, 120, (64, 10)), "mask": np.ones((64, 10), np.int64)}
    result = quantize_qat_export(str(path), tmp_path / "thinned.int8.onnx", inputs=feeds)
    assert result.verification.problem(None) is None and result.verification.samples == 64


def test_a_head_modifier_missing_the_output_projection_is_a_located_error():
    model = _bert()
    recipe = _recipe(r"['re:.*attention\.self\.(query|key|value)\.weight']", BERT_FFN)
    with pytest.raises(RecipeError, match=r"modifiers\[1\].*mask_type.*attention\.output\.dense\.weight.*same modifier"):
        ScheduledModifierManager.from_yaml(recipe).modify(model, torch.optim.SGD(model.parameters(), lr=0.1), 4)


def test_head_pruning_on_a_layer_that_is_no_attention_projection_is_a_located_error():
    model = _bert()
    recipe = _recipe(r"['re:.*intermediate\.dense\.weight']", r"['re:.*output\.dense\.weight']")
    with pytest.raises(RecipeError, match=r"intermediate\.dense\.weight: mask_type head: recal traced no attention"):
        ScheduledModifierManager.from_yaml(recipe).modify(model, torch.optim.SGD(model.parameters(), lr=0.1), 4)


def test_head_groups_rules():
    att = Attention("a", "a.q.weight", "a.k.weight", "a.v.weight", "a.o.weight", heads=4, kv_heads=2, head_dim=3,
                    biases=(("a.q.weight", "a.q.bias"), ("a.v.weight", "a.v.bias")))
    assert att.widths() == {"a.q.weight": 6, "a.k.weight": 3, "a.v.weight": 3, "a.o.weight": 6}
    assert att.bias_widths() == {"a.q.bias": 6, "a.v.bias": 3}
    pruned = {w: (1, "head") for w in att.widths()}
    assert head_groups([att], pruned) == [(att, 1)]
    with pytest.raises(CouplingError, match="a.o.weight in the same modifier"):
        head_groups([att], {**pruned, "a.o.weight": (2, "head")})
    blocked = Attention(**{**att.__dict__, "blockers": ("the model's output",)})
    with pytest.raises(CouplingError, match="also reach the model's output"):
        head_groups([blocked], pruned)
    zeros = {"a.v.weight": torch.zeros(6, 8), "a.v.bias": torch.zeros(6), "a.o.weight": torch.ones(8, 12)}
    zeros["a.v.weight"][3:] = 1  # unit 1 of the values is alive
    keep = live_heads(att, lambda n: (zeros[n] == 0).numpy())
    assert keep.tolist() == [False, True]
    zeros["a.v.weight"][:] = 1
    zeros["a.o.weight"][:, 6:] = 0  # unit 1's output columns unread
    assert live_heads(att, lambda n: (zeros[n] == 0).numpy()).tolist() == [True, False]


def _head_recipe(params):
    return f"""
- !EpochRangeModifier {{start_epoch: 0, end_epoch: 2}}
- !GradualKSModifier {{params: {params}, init_sparsity: 0.5, final_sparsity: 0.5, start_epoch: 0, end_epoch: 1,
                      update_frequency: 1, mask_type: head}}
"""


def test_a_packed_qkv_is_one_weight_of_three_blocks():
    """GPT-2's c_attn: Q, K and V as consecutive row blocks of one weight; a unit's rows are taken from each."""
    att = Attention("a", "a.c.weight", "a.c.weight", "a.c.weight", "a.o.weight", heads=4, kv_heads=2, head_dim=3,
                    biases=(("a.c.weight", "a.c.bias"),), offsets=(0, 12, 18))
    assert att.widths() == {"a.c.weight": (6, 3, 3), "a.o.weight": 6}
    assert att.packing_problem({"a.c.weight": 24}) is None
    assert "do not fill its 30 rows" in att.packing_problem({"a.c.weight": 30})
    assert unit_rows([1], (6, 3, 3), 2).tolist() == [6, 7, 8, 9, 10, 11, 15, 16, 17, 21, 22, 23]
    weights = {"a.c.weight": torch.ones(24, 8), "a.c.bias": torch.ones(24), "a.o.weight": torch.ones(8, 12)}
    weights["a.c.weight"][21:] = 0  # unit 1's value rows (the third block's second unit)
    weights["a.c.bias"][21:] = 0
    assert live_heads(att, lambda n: (weights[n] == 0).numpy()).tolist() == [True, False]


def _thin_checked(model, heads, spaces):
    """``thin`` a trained causal LM: the attentions' ``(heads before, after)``, the thinned spaces' ``(channels before,
    after)`` as given, and the same logits as the masked model. Returns the ids it checked with."""
    model.eval()
    ids = _batch("gpt2", 99)[0]["input_ids"]
    with torch.no_grad():
        masked = model(input_ids=ids).logits
    report = thin(model)
    assert [(b, a) for _, b, a in report.heads] == heads, str(report)
    assert sorted((b, a) for _, b, a in report.spaces if a < b) == spaces, str(report)
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, masked, atol=1e-5 * float(masked.abs().max()), rtol=0)
    return ids


def test_a_per_head_packed_qkv_holds_each_units_rows_together():
    """GPT-NeoX's query_key_value: each head's Q, K and V rows side by side; a unit is one contiguous run."""
    att = Attention("a", "a.c.weight", "a.c.weight", "a.c.weight", "a.o.weight", heads=2, kv_heads=2, head_dim=3,
                    biases=(("a.c.weight", "a.c.bias"),), offsets=(0, 3, 6), interleaved=True)
    assert att.widths() == {"a.c.weight": 9, "a.o.weight": 3}
    assert att.rows(2).tolist() == [[6, 7, 8], [15, 16, 17]]
    assert att.packing_problem({"a.c.weight": 18}) is None
    assert "one head after another" in att.packing_problem({"a.c.weight": 27})
    assert unit_rows([1], 9, 2).tolist() == list(range(9, 18))
    weights = {"a.c.weight": torch.ones(18, 4), "a.c.bias": torch.ones(18), "a.o.weight": torch.ones(4, 6)}
    weights["a.c.weight"][15:] = 0  # unit 1's value rows
    weights["a.c.bias"][15:] = 0
    assert live_heads(att, lambda n: (weights[n] == 0).numpy()).tolist() == [True, False]


def _rows(blocks):
    """``[heads, head_dim]`` rows from ``(first row, head size)`` per head."""
    return np.array([np.arange(start, start + size) for start, size in blocks])


@pytest.mark.parametrize("case", ["gpt2", "neox", "falcon", "llama-gqa", "repeated-kv"])
def test_head_layout_reads_blocks_per_head_and_grouped_layouts_off_the_traced_rows(case):
    d = 4
    w = ("c", "c", "c")
    if case == "gpt2":  # 4 heads: Q block, K block, V block
        rows, expected = (_rows([(h * d, d) for h in range(4)]), _rows([(16 + h * d, d) for h in range(4)]),
                          _rows([(32 + h * d, d) for h in range(4)])), (4, 4, (0, 16, 32), False)
    elif case == "neox":  # per head [q k v]
        rows, expected = tuple(_rows([(h * 3 * d + r * d, d) for h in range(4)]) for r in range(3)), \
            (4, 4, (0, 4, 8), True)
    elif case == "falcon":  # 2 key/value groups of [q q k v]; key and value broadcast to the 4 query heads
        rows = (_rows([(g * 4 * d + i * d, d) for g in range(2) for i in range(2)]),
                _rows([(g * 4 * d + 2 * d, d) for g in range(2) for _ in range(2)]),
                _rows([(g * 4 * d + 3 * d, d) for g in range(2) for _ in range(2)]))
        expected = (4, 2, (0, 8, 12), True)
    elif case == "llama-gqa":  # separate weights, 2 key/value heads read by 4 query heads
        w = ("q", "k", "v")
        rows, expected = (_rows([(h * d, d) for h in range(4)]), _rows([(h * d, d) for h in range(2)]),
                          _rows([(h * d, d) for h in range(2)])), (4, 2, (0, 0, 0), False)
    else:  # repeat_kv: the key heads repeated to 4 at the attention
        w = ("q", "k", "v")
        rows, expected = (_rows([(h * d, d) for h in range(4)]), _rows([(h // 2 * d, d) for h in range(4)]),
                          _rows([(h // 2 * d, d) for h in range(4)])), (4, 2, (0, 0, 0), False)
    layout = head_layout(w, rows)
    assert (layout.heads, layout.kv_heads, layout.offsets, layout.interleaved) == expected and layout.head_dim == d


def test_head_layout_says_why_rows_are_no_layout_thinning_can_slice():
    d = 2
    q = _rows([(h * d, d) for h in range(4)])
    k = v = _rows([(h * d, d) for h in range(2)])
    swapped = q[[0, 2, 1, 3]]  # the query heads reading key head 0 are rows 0-1 and 4-5
    assert "query rows of one key/value head are not consecutive" in head_layout(("q", "k", "v"), (swapped, k, v))
    assert "same rows" in head_layout(("q", "k", "v"), (np.repeat(q[:1], 4, 0), k, v))
    assert "evenly" in head_layout(("q", "k", "v"), (q[:3], k, v))
    assert "do not pair" in head_layout(("q", "k", "v"), (q, k, v[[0, 0]]))
    spread = _rows([(h * 3 * d, d) for h in range(4)])  # heads 3 * d rows apart in a weight only they read
    k = v = _rows([(h * d, d) for h in range(4)])
    assert "rows apart" in head_layout(("q", "k", "v"), (spread, k, v))


def _gpt2():
    config = transformers.GPT2Config(vocab_size=120, n_positions=32, n_embd=64, n_layer=2, n_head=4,
                                     bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(config)


GPT2_HEADS = r"['re:.*attn\.c_attn\.weight', 're:.*attn\.c_proj\.weight']"
GPT2_FFN = r"['re:.*mlp\.c_fc\.weight']"
GPT2_QAT = {"float": "", "int8": "- !QuantizationModifier {start_epoch: 0, reduce_range: true}\n",
            "int4": "- !QuantizationModifier {start_epoch: 2, scheme: {input_activations: null, weights: {num_bits: 4, "
                    "group_size: 16}}}\n"}


@pytest.mark.slow
@pytest.mark.parametrize("qat", sorted(GPT2_QAT))
def test_gpt2s_packed_c_attn_is_pruned_and_thinned_per_head(qat, tmp_path):
    """GPT-2 keeps Q, K and V in one Conv1D (c_attn, weight [in, 3 * hidden]) split after the projection: a head
    prunes its rows of each block and its columns of c_proj together, FFN neurons go by c_fc's filters; ``thin``
    slices the Conv1Ds and ``split_size``, the thinned model computes what the masked one did, converts (float,
    int8 QAT from the start, or int4 weight-only after pruning) verified, and ``load_thinned`` rebuilds it."""
    from recal_onnx import quantize_qat_export
    from recal_torch import export_onnx

    from tests.support.torch_models import CausalLMLogits

    torch.manual_seed(0)
    model = _gpt2()
    _train("gpt2", model, _recipe(GPT2_HEADS, GPT2_FFN) + GPT2_QAT[qat])
    for block in model.transformer.h:
        rows = block.attn.c_attn.weight.t().reshape(3, 4, -1)  # [Q|K|V, head, head_dim * inputs]
        dead = (rows == 0).all(2)
        assert dead.sum(1).tolist() == [2, 2, 2] and (dead == dead[2]).all(), "a head's Q, K and V rows together"
        assert int((block.mlp.c_fc.weight == 0).all(0).sum()) == 128
    ids = _thin_checked(model, [(4, 2), (4, 2)], [(256, 128), (256, 128)])
    attention = model.transformer.h[0].attn
    assert attention.c_attn.weight.shape == (64, 96) and attention.split_size == 32 and attention.num_heads == 2
    path = export_onnx(CausalLMLogits(model).eval(), ids, tmp_path / "gpt2.onnx", input_names=["ids"],
                       dynamic_sequence=True)
    result = quantize_qat_export(str(path), tmp_path / "gpt2.out.onnx", inputs={"ids": ids.numpy()}) if qat != \
        "float" else None
    if result is not None:
        assert result.verification.problem(None) is None, result.verification
        kinds = [n.op_type for n in result.model.graph.node]
        if qat == "int4":  # every thinned Conv1D (4 a layer) and the LM head as MatMulNBits
            assert kinds.count("MatMulNBits") == 9, kinds
    state = {k: v for k, v in model.state_dict().items() if "fake_quant" not in k and "post_process" not in k}
    rebuilt = _gpt2()
    load_thinned(rebuilt, copy.deepcopy(state))
    assert rebuilt.transformer.h[1].attn.split_size == 32 and rebuilt.transformer.h[1].mlp.c_fc.nf == 128
    if qat == "float":
        with torch.no_grad():
            torch.testing.assert_close(rebuilt.eval()(input_ids=ids).logits, model(input_ids=ids).logits, atol=0,
                                       rtol=0)


def _neox():
    config = transformers.GPTNeoXConfig(vocab_size=120, hidden_size=64, num_attention_heads=4, intermediate_size=128,
                                        num_hidden_layers=2, rotary_pct=0.25, max_position_embeddings=64,
                                        attention_bias=True, hidden_dropout=0.0, attention_dropout=0.0)
    return transformers.GPTNeoXForCausalLM(config)


def _falcon(grouped):
    arch = {"new_decoder_architecture": True, "num_kv_heads": 2} if grouped is True else {
        "new_decoder_architecture": False, "multi_query": grouped == "multi-query"}
    config = transformers.FalconConfig(vocab_size=120, hidden_size=64, num_attention_heads=4, num_hidden_layers=2,
                                       alibi=False, bias=True, hidden_dropout=0.0, attention_dropout=0.0, **arch)
    return transformers.FalconForCausalLM(config)


PACKED_PER_HEAD = {  # build, units (key/value heads), FFN width, QAT
    "gpt-neox-int8": (_neox, 4, 128, GPT2_QAT["int8"]),
    "falcon-grouped-int4": (lambda: _falcon(True), 2, 256, GPT2_QAT["int4"]),
    "falcon-float": (lambda: _falcon(False), 4, 256, ""),
}
PER_HEAD_PARAMS = r"['re:.*attention\.query_key_value\.weight', 're:.*attention\.dense\.weight']"


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(PACKED_PER_HEAD))
def test_qkv_packed_per_head_is_pruned_and_thinned_per_head(name, tmp_path):
    """GPT-NeoX and Falcon keep each head's (each key/value group's) Q, K and V rows together in one
    query_key_value, split after the heads are: recal finds each head's rows by running the ops between the
    projection and the attention on row numbers, prunes a unit's rows together with its columns of the output
    projection, and ``thin`` slices them; Falcon's FalconLinear (``x @ W.T + b``) is a layer and a QAT linear. The
    thinned model computes what the masked one did, converts verified, and ``load_thinned`` rebuilds it."""
    from recal_onnx import quantize_qat_export
    from recal_torch import export_onnx

    from tests.support.torch_models import CausalLMLogits

    from recal_onnx import UnconvertedOpsWarning

    build, units, ffn, qat = PACKED_PER_HEAD[name]
    torch.manual_seed(0)
    model = build()
    _train("gpt2", model, _recipe(PER_HEAD_PARAMS, r"['re:.*mlp\.dense_h_to_4h\.weight']") + qat)
    blocks = model.gpt_neox.layers if name.startswith("gpt-neox") else model.transformer.h
    for block in blocks:
        attention = getattr(block, "attention", None) or block.self_attention
        dead = (attention.query_key_value.weight.reshape(units, -1) == 0).all(1)
        assert int(dead.sum()) == units // 2, "a unit's queries, key and value rows, all or none"
        assert (attention.dense.weight.reshape(64, units, -1) == 0).all(2).all(0).tolist() == dead.tolist()
        assert int((block.mlp.dense_h_to_4h.weight == 0).all(1).sum()) == ffn // 2
    if name == "falcon-grouped-int4":  # the converter cannot follow Falcon's grouped layout: it says so
        ids = torch.randint(0, 120, (2, 8))
        masked = export_onnx(CausalLMLogits(model).eval(), ids, tmp_path / "masked.onnx", input_names=["ids"])
        with pytest.warns(ThinningWarning, match=r"2 attentions keep heads that look pruned .*\n  'node_Softmax_\d+' "
                                                 r"in module lm\.transformer\.h\.0\.self_attention: 64 outputs"):
            warnings.simplefilter("ignore", UnconvertedOpsWarning)
            assert len(quantize_qat_export(str(masked), inputs={"ids": ids.numpy()}).heads_kept) == 2
    ids = _thin_checked(model, [(4, 2), (4, 2)], [(ffn, ffn // 2)] * 2)
    path = export_onnx(CausalLMLogits(model).eval(), ids, tmp_path / "m.onnx", input_names=["ids"],
                       dynamic_sequence=True)
    if qat:
        with warnings.catch_warnings():  # the layer norms (and the residual adds between them) stay float, named
            warnings.simplefilter("ignore", UnconvertedOpsWarning)
            result = quantize_qat_export(str(path), tmp_path / "m.out.onnx", inputs={"ids": ids.numpy()})
        assert result.verification.problem(None) is None, result.verification
        kinds = [n.op_type for n in result.model.graph.node]
        assert kinds.count("MatMulNBits" if "int4" in name else "QGemm") == 9, kinds  # 4 layers a block, the LM head
    state = {k: v for k, v in model.state_dict().items() if not any(
        s in k for s in ("fake_quant", "post_process", "recal_sites"))}
    rebuilt = build()
    load_thinned(rebuilt, copy.deepcopy(state))
    if not qat:
        assert rebuilt.transformer.h[1].self_attention.num_heads == 2
        with torch.no_grad():
            torch.testing.assert_close(rebuilt.eval()(input_ids=ids).logits, model(input_ids=ids).logits, atol=0,
                                       rtol=0)


class _MixedHeads(torch.nn.Module):
    """An attention whose queries pass a running sum across heads on the way: its heads cannot be removed alone."""

    def __init__(self):
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (torch.nn.Linear(16, 16) for _ in range(4))

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = (p(x).view(b, s, 4, 4).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        out = torch.nn.functional.scaled_dot_product_attention(q.cumsum(1), k, v)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, 16))


def test_heads_an_op_mixes_one_shared_key_value_head_and_scores_by_einsum_are_located_errors_that_say_why():
    falcon = _falcon("multi-query")  # Falcon-7B's multi-query attention: every query head reads one key/value head
    manager = ScheduledModifierManager.from_yaml(_head_recipe(PER_HEAD_PARAMS))
    with pytest.raises(RecipeError, match=r"self_attention: mask_type head: its 4 heads are one unit \(they share one "
                                          r"key/value head\).*leave this attention out of params"):
        manager.modify(falcon, torch.optim.SGD(falcon.parameters(), lr=0.1), 2)
    model = _MixedHeads()
    manager = ScheduledModifierManager.from_yaml(_head_recipe(r"['re:.*_proj\.weight']"))
    with pytest.raises(RecipeError, match=r"mask_type head: its heads also reach .*cumsum.*not an op recal "
                                          r"follows a head through"):
        manager.modify(model, torch.optim.SGD(model.parameters(), lr=0.1), 2, example_inputs=torch.randn(1, 3, 16))
    einsum = _EinsumAttention()
    manager = ScheduledModifierManager.from_yaml(_head_recipe(r"['re:.*_proj\.weight']"))
    with pytest.raises(RecipeError, match=r"none traced in this model: an attention whose scores are not one matmul"):
        manager.modify(einsum, torch.optim.SGD(einsum.parameters(), lr=0.1), 2, example_inputs=torch.randn(1, 3, 16))


class _EinsumAttention(_MixedHeads):
    """Scores by einsum: no product of queries and keys recal finds."""

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = (p(x).view(b, s, 4, 4).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        weights = torch.einsum("bhqd,bhkd->bhqk", q, k).softmax(-1)
        return self.o_proj((weights @ v).transpose(1, 2).reshape(b, s, 16))


def _eager(kind):
    if kind == "bert":
        return transformers.BertForMaskedLM._from_config(transformers.BertConfig(
            hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=96, vocab_size=120,
            hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0), attn_implementation="eager")
    if kind == "llama":
        return transformers.LlamaForCausalLM._from_config(transformers.LlamaConfig(
            vocab_size=120, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2), attn_implementation="eager")
    return transformers.BloomForCausalLM(transformers.BloomConfig(vocab_size=120, hidden_size=64, n_layer=2, n_head=4,
                                                                  hidden_dropout=0.0, attention_dropout=0.0))


EAGER = {"bert": (BERT_HEADS, BERT_FFN, 96), "llama": (LLAMA_HEADS, LLAMA_FFN, 96),
         "bloom": (r"['re:.*self_attention\.query_key_value\.weight', 're:.*self_attention\.dense\.weight']",
                   r"['re:.*mlp\.dense_h_to_4h\.weight']", 256)}


@pytest.mark.slow
@pytest.mark.parametrize("kind", sorted(EAGER))
def test_attention_written_out_is_pruned_by_head_and_thinned_where_the_model_allows(kind):
    """softmax(q @ kᵀ) @ v written out (transformers' eager attention; BLOOM's baddbmm with ALiBi and its heads
    merged into the batch) is an attention like scaled_dot_product_attention: its heads pruned whole and thinned.
    BLOOM's ALiBi slopes are built per head for the whole model, so its heads stay (a ThinningWarning) while its
    FFN neurons go."""
    heads, ffn, width = EAGER[kind]
    torch.manual_seed(0)
    model = _eager(kind)
    _train("gpt2", model, _recipe(heads, ffn))
    if kind == "bloom":
        dead = (model.transformer.h[0].self_attention.query_key_value.weight.reshape(4, -1) == 0).all(1)
        assert int(dead.sum()) == 2, "pruned by head all the same: each head's Q, K and V rows together"
        with pytest.warns(ThinningWarning, match=r"the heads of transformer\.h\.0\.self_attention, "
                                                 r"transformer\.h\.1\.self_attention stay"):
            _thin_checked(model, [], [(width, width // 2)] * 2)
    else:
        _thin_checked(model, [(4, 2), (4, 2)], [(width, width // 2)] * 2)


def _config(name):
    """One-layer models of architectures whose attention code differs (rotary by interleaved pairs, norms of each
    head's queries and keys, packed and per-head layouts, cross attention), from their real definitions."""
    t, small = transformers, {"vocab_size": 128}
    decoder = {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 1, "num_attention_heads": 4, **small}
    return {
        "gpt-j": lambda: t.GPTJForCausalLM(t.GPTJConfig(n_embd=64, n_layer=1, n_head=4, rotary_dim=8, n_positions=64,
                                                        **small)),
        "codegen": lambda: t.CodeGenForCausalLM(t.CodeGenConfig(n_embd=64, n_layer=1, n_head=4, rotary_dim=8,
                                                                n_positions=64, **small)),
        "qwen3": lambda: t.Qwen3ForCausalLM(t.Qwen3Config(num_key_value_heads=2, head_dim=16, **decoder)),
        "gemma3": lambda: t.Gemma3ForCausalLM(t.Gemma3TextConfig(num_key_value_heads=2, head_dim=16, **decoder)),
        "phi": lambda: t.PhiForCausalLM(t.PhiConfig(partial_rotary_factor=0.5, **decoder)),
        "gpt-bigcode": lambda: t.GPTBigCodeForCausalLM(t.GPTBigCodeConfig(n_embd=64, n_layer=1, n_head=4,
                                                                          multi_query=False, n_positions=64, **small)),
        "bart": lambda: t.BartForConditionalGeneration(t.BartConfig(
            d_model=64, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4, decoder_attention_heads=4,
            encoder_ffn_dim=96, decoder_ffn_dim=96, **small)),
        "olmo2": lambda: t.Olmo2ForCausalLM(t.Olmo2Config(**decoder)),
        "t5": lambda: t.T5ForConditionalGeneration(t.T5Config(d_model=64, d_kv=16, d_ff=96, num_layers=1, num_heads=4,
                                                              decoder_start_token_id=0, **small)),
        "swin": lambda: t.SwinForImageClassification(t.SwinConfig(image_size=32, patch_size=4, embed_dim=64,
                                                                  depths=[1], num_heads=[4], window_size=4)),
        "whisper": lambda: t.WhisperForConditionalGeneration(t.WhisperConfig(
            d_model=64, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4, decoder_attention_heads=4,
            encoder_ffn_dim=96, decoder_ffn_dim=96, num_mel_bins=16, max_source_positions=16, max_target_positions=16,
            pad_token_id=0, bos_token_id=0, eos_token_id=0, decoder_start_token_id=0, **small)),
    }[name]()


def _one_shot_heads(model):
    """Half the heads of every attention recal traced, pruned at once: the masked model."""
    from recal_torch.tracing import exported_graph

    attentions = exported_graph(model.eval()).attentions
    blocked = [a.blockers[0] for a in attentions if a.blockers]
    if blocked:
        return blocked
    weights = sorted({w for a in attentions for w in (a.query, a.key, a.value, a.output)})
    manager = ScheduledModifierManager.from_yaml(_head_recipe(weights))
    optimizer = manager.modify(model, torch.optim.SGD(model.parameters(), lr=0.0), 1)
    optimizer.step()
    manager.finalize()
    return []


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gpt-j", "codegen", "qwen3", "gemma3", "phi", "gpt-bigcode", "bart", "t5", "swin",
                                  "whisper"])
def test_attention_code_of_many_architectures_is_followed_pruned_by_head_and_thinned(name):
    """(T5 and Swin add a relative position bias per head from a table of their own: the table loses the removed
    heads' entries; T5 is traced with its decoder's dummy inputs too; Whisper with one silent clip of its config's
    length, and its decoder's start token.)"""
    from recal_torch.tracing import example_inputs_of

    torch.manual_seed(0)
    model = _config(name)
    assert _one_shot_heads(model) == []
    args, kwargs = example_inputs_of(model)
    with torch.no_grad():
        masked = model(*args, **kwargs).logits
    report = thin(model)
    assert report.heads and all((b, a) == (4, 2) for _, b, a in report.heads), str(report)
    with torch.no_grad():
        torch.testing.assert_close(model(*args, **kwargs).logits, masked, atol=1e-5 * float(masked.abs().max()),
                                   rtol=0)


def test_thin_keeps_the_heads_of_attentions_sharing_a_table_and_thins_the_others():
    """T5's self attentions add one bias table, held by the first layer, for every layer: with other heads dead in
    each layer, removing them would misalign the table, so those heads stay (a ThinningWarning names the
    attentions); the one-layer decoder's cross attention, whose bias is its own, loses its dead head all the
    same."""
    torch.manual_seed(0)
    model = transformers.T5ForConditionalGeneration(transformers.T5Config(
        d_model=64, d_kv=16, d_ff=96, num_layers=2, num_decoder_layers=1, num_heads=4, decoder_start_token_id=0,
        vocab_size=128)).eval()
    with torch.no_grad():  # head 0 of the first encoder layer, head 1 of the second, head 2 of a cross attention
        model.encoder.block[0].layer[0].SelfAttention.v.weight[0:16] = 0
        model.encoder.block[1].layer[0].SelfAttention.v.weight[16:32] = 0
        model.decoder.block[0].layer[1].EncDecAttention.v.weight[32:48] = 0
    ids = torch.randint(0, 128, (2, 6))
    with torch.no_grad():
        masked = model(input_ids=ids, decoder_input_ids=ids).logits
    with pytest.warns(ThinningWarning, match=r"the heads of encoder\.block\.0\.layer\.0\.SelfAttention, "
                                             r"encoder\.block\.1\.layer\.0\.SelfAttention stay"):
        report = thin(model)
    assert [(name, b, a) for name, b, a in report.heads] == [("decoder.block.0.layer.1.EncDecAttention", 4, 3)]
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids, decoder_input_ids=ids).logits, masked,
                                   atol=1e-5 * float(masked.abs().max()), rtol=0)


def test_a_norm_over_every_heads_queries_is_a_located_reason_not_a_wrong_thinning():
    """OLMo 2 normalizes the queries and keys over all heads at once: removing a head would change every other
    head's norm, so its heads are not removed, and the reason names the op."""
    assert "q_norm (aten.mean.dim) (not an op recal follows a head through: it mixes the rows of more than one " \
           "head)" in _one_shot_heads(_config("olmo2"))[0]


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


def test_tensorflow_refuses_head_pruning_with_a_located_error():
    from recal_core.model_plan import plan_model
    from recal_core.params import ParamInfo
    from recal_core.recipe import load_recipe

    recipe = load_recipe(_head_recipe("[q, k, v, o]"))
    infos = [ParamInfo(f"{n}.weight", n, True, (8, 8), (0, 1)) for n in "qkvo"]
    with pytest.raises(RecipeError, match=r"modifiers\[1\].*mask_type.*only the PyTorch backend"):
        plan_model(recipe.bind(2), infos, {i.name: 64 for i in infos})


class _Logits(torch.nn.Module):
    """A Hugging Face model returning its logits (what the exporters take)."""

    def __init__(self, model, keys):
        super().__init__()
        self.model, self.keys = model, keys

    def forward(self, *inputs):
        return self.model(**dict(zip(self.keys, inputs))).logits


@pytest.mark.slow
@pytest.mark.parametrize("name,dynamo", [("bert", False), ("vit", True), ("bert", True), ("llama", False),
                                        ("llama", True), ("gpt2", False), ("gpt2", True), ("neox", True)],
                         ids=["bert-torchscript", "vit-dynamo", "bert-dynamo", "llama-torchscript", "llama-dynamo",
                              "gpt2-torchscript", "gpt2-dynamo", "neox-dynamo"])
def test_the_converter_thins_a_masked_export_as_thin_does(name, dynamo, tmp_path):
    import numpy as np
    import onnx
    import onnxruntime as ort

    from recal_onnx import quantize_qat_export
    from recal_onnx import UnconvertedOpsWarning
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


def test_the_tensorflow_graph_api_refuses_head_pruning_as_pytorch_only():
    tf = pytest.importorskip("tensorflow")
    from recal_tf import ScheduledModifierManager as TFManager
    from recal_tf.utils import tf_compat

    with tf_compat.Graph().as_default():
        x = tf_compat.placeholder(tf.float32, [None, 8])
        for name in "qkvo":
            w = tf_compat.get_variable(f"{name}/weight", shape=[8, 8], use_resource=True)
            x = tf.matmul(x, w)
        tf_compat.train.get_or_create_global_step()
        manager = TFManager.from_yaml(_head_recipe("['re:[qkvo]/weight']"))
        with pytest.raises(RecipeError, match=r"modifiers\[1\].*mask_type.*only the PyTorch backend"):
            manager.create_ops(steps_per_epoch=2)


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
