"""The layouts heads are read in: packed and per-head packed QKV (GPT-2, GPT-NeoX, Falcon), attention written out by
hand, the attention code of many architectures, and the located reasons a layout cannot be thinned."""

import copy
import warnings

import numpy as np
import pytest
import torch

from recal_core import RecipeError
from recal_core.head_coupling import Attention, head_layout, live_heads, unit_rows
from recal_torch import ScheduledModifierManager, ThinningWarning, load_thinned, thin

transformers = pytest.importorskip("transformers")
from tests.torch.transformer_models import (  # noqa: E402
    EAGER,
    GPT2_FFN,
    GPT2_HEADS,
    GPT2_QAT,
    PACKED_PER_HEAD,
    PER_HEAD_PARAMS,
    _config,
    _eager,
    _EinsumAttention,
    _falcon,
    _gpt2,
    _head_recipe,
    _MixedHeads,
    _one_shot_heads,
    _recipe,
    _rows,
    _thin_checked,
    _train,
)


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


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(PACKED_PER_HEAD))
def test_qkv_packed_per_head_is_pruned_and_thinned_per_head(name, tmp_path):
    """GPT-NeoX and Falcon keep each head's (each key/value group's) Q, K and V rows together in one
    query_key_value, split after the heads are: recal finds each head's rows by running the ops between the
    projection and the attention on row numbers, prunes a unit's rows together with its columns of the output
    projection, and ``thin`` slices them; Falcon's FalconLinear (``x @ W.T + b``) is a layer and a QAT linear. The
    thinned model computes what the masked one did, converts verified, and ``load_thinned`` rebuilds it."""
    from recal_onnx import UnconvertedOpsWarning, quantize_qat_export
    from recal_torch import export_onnx
    from tests.support.torch_models import CausalLMLogits

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
