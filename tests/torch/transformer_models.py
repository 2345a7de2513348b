"""The small Hugging Face transformers (random weights from configs), batches and recipes the head-pruning tests share."""

import numpy as np
import pytest
import torch

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


class _UserWrapper(torch.nn.Module):
    """A user's own wrapper around a Hugging Face classifier: positional inputs in, logits out."""

    def __init__(self, bert=None):
        super().__init__()
        self.bert = bert if bert is not None else _bert()

    def forward(self, ids, mask):
        return self.bert(input_ids=ids, attention_mask=mask).logits


def _head_recipe(params):
    return f"""
- !EpochRangeModifier {{start_epoch: 0, end_epoch: 2}}
- !GradualKSModifier {{params: {params}, init_sparsity: 0.5, final_sparsity: 0.5, start_epoch: 0, end_epoch: 1,
                      update_frequency: 1, mask_type: head}}
"""


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


def _rows(blocks):
    """``[heads, head_dim]`` rows from ``(first row, head size)`` per head."""
    return np.array([np.arange(start, start + size) for start, size in blocks])


def _gpt2():
    config = transformers.GPT2Config(vocab_size=120, n_positions=32, n_embd=64, n_layer=2, n_head=4,
                                     bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(config)


GPT2_HEADS = r"['re:.*attn\.c_attn\.weight', 're:.*attn\.c_proj\.weight']"


GPT2_FFN = r"['re:.*mlp\.c_fc\.weight']"


GPT2_QAT = {"float": "", "int8": "- !QuantizationModifier {start_epoch: 0, reduce_range: true}\n",
            "int4": "- !QuantizationModifier {start_epoch: 2, scheme: {input_activations: null, weights: {num_bits: 4, "
                    "group_size: 16}}}\n"}


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


class _Logits(torch.nn.Module):
    """A Hugging Face model returning its logits (what the exporters take)."""

    def __init__(self, model, keys):
        super().__init__()
        self.model, self.keys = model, keys

    def forward(self, *inputs):
        return self.model(**dict(zip(self.keys, inputs))).logits
