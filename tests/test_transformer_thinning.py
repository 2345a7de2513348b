"""Head and FFN-neuron pruning of Hugging Face transformers (BERT, ViT, Llama with grouped-query attention),
and thinning: exact counts per layer, the four projections of a head pruned together, and a thinned model
that computes what the masked one did."""

import copy

import pytest
import torch

from recal_core import RecipeError
from recal_core.channel_coupling import CouplingError
from recal_core.head_coupling import Attention, head_groups, live_heads
from recal_torch import ScheduledModifierManager, thin

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
    # the thinned model trains and saves as any model does
    state = copy.deepcopy(model.state_dict())
    model(**inputs).logits.sum().backward()
    assert all(state[k].shape == v.shape for k, v in model.state_dict().items())


def test_the_head_count_per_layer_follows_thinning():
    torch.manual_seed(0)
    model = _bert()
    _train("bert", model, _recipe(BERT_HEADS, BERT_FFN, head_sparsity=0.25, ffn_sparsity=0.0))
    thin(model)
    for layer in model.bert.encoder.layer:
        assert layer.attention.self.num_attention_heads == 3
        assert layer.attention.self.query.out_features == 3 * 16
        assert layer.attention.output.dense.in_features == 3 * 16


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
                    biases=("a.q.bias", "a.v.bias"))
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
