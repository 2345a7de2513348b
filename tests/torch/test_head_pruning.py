"""Head and FFN-neuron pruning of Hugging Face transformers (BERT, ViT, Llama with grouped-query attention), and
thinning: exact counts per layer, the four projections of a head pruned together, a thinned model that computes what
the masked one did; the TensorFlow front ends refuse it."""

import copy

import numpy as np
import pytest
import torch

from recal_core import RecipeError
from recal_core.channel_coupling import CouplingError
from recal_core.head_coupling import Attention, head_groups, live_heads
from recal_torch import ScheduledModifierManager, load_thinned, thin

transformers = pytest.importorskip("transformers")
from tests.torch.transformer_models import (  # noqa: E402
    BERT_FFN,
    BERT_HEADS,
    MODELS,
    _batch,
    _bert,
    _head_recipe,
    _recipe,
    _train,
    _UserWrapper,
)


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


@pytest.mark.parametrize("wrapped, qat_start", [(True, 0), (False, 2)], ids=["wrapped-qat-throughout",
                                                                             "hf-qat-after-pruning"])
def test_one_recipe_prunes_heads_and_neurons_with_qat_then_thins_and_converts(tmp_path, wrapped, qat_start):
    """Head pruning, FFN neuron pruning and QAT in one recipe, QAT from the start or after the pruning: the
    inputs given to ``modify`` serve ``thin`` (not given again), the QAT layers trace, the thinned model computes
    what the masked one did (1e-5 of the logits' range), and its export converts to int8, verified."""

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


def test_tensorflow_refuses_head_pruning_with_a_located_error():
    from recal_core.model_plan import plan_model
    from recal_core.params import ParamInfo
    from recal_core.recipe import load_recipe

    recipe = load_recipe(_head_recipe("[q, k, v, o]"))
    infos = [ParamInfo(f"{n}.weight", n, True, (8, 8), (0, 1)) for n in "qkvo"]
    with pytest.raises(RecipeError, match=r"modifiers\[1\].*mask_type.*only the PyTorch backend"):
        plan_model(recipe.bind(2), infos, {i.name: 64 for i in infos})


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
