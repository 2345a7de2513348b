"""A CNN's planned recipe (issue 71, ``scheme="w8a8"``): each convolution and Linear in int8 (weights and input) or
float, its filters pruned with it. The int8 score is the loss recal's own QAT model has with that layer alone
quantized; a convolution reading one pruned space and making another pairs a level of each, a depthwise convolution
between them thins on both sides; and the recipe written trains, thins to the planned channels and converts with
the float layers left float."""

import itertools
import warnings

import numpy as np
import pytest
import torch
from torch import nn

from recal_core import load_recipe
from recal_core.precision_plan import FLOAT, Candidate, LayerCandidates, macs, matmul_shape, size_bounds, solve

from tests.support.torch_models import train_planned


class Chain(nn.Module):
    """conv-BN-ReLU twice in a chain (c2 reads c1's channels and makes its own), a depthwise conv, a 1x1 conv, a
    global pool and a Linear: torchvision's building blocks."""

    def __init__(self):
        super().__init__()
        self.c1, self.b1 = nn.Conv2d(3, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16)
        self.c2, self.b2 = nn.Conv2d(16, 32, 3, padding=1, bias=False), nn.BatchNorm2d(32)
        self.dw, self.b3 = nn.Conv2d(32, 32, 3, padding=1, groups=32, bias=False), nn.BatchNorm2d(32)
        self.c3, self.b4 = nn.Conv2d(32, 16, 1, bias=False), nn.BatchNorm2d(16)
        self.fc = nn.Linear(16, 4)

    def forward(self, x):
        x = torch.relu(self.b1(self.c1(x)))
        x = torch.relu(self.b2(self.c2(x)))
        x = torch.relu(self.b3(self.dw(x)))
        x = torch.relu(self.b4(self.c3(x)))
        return self.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(x, 1), 1))


def _data(seed=0):
    torch.manual_seed(seed)
    model = Chain()
    with torch.no_grad():  # BatchNorm statistics of the data, as a trained model holds them
        model.train()
        for _ in range(3):
            model(torch.randn(16, 3, 12, 12))
    model.eval()
    batches = [(torch.randn(8, 3, 12, 12), torch.randint(0, 4, (8,))) for _ in range(2)]
    return model, batches, lambda m, b: nn.functional.cross_entropy(m(b[0]), b[1])


def test_a_cnn_is_measured_layer_by_layer_with_its_filters_and_left_as_it_was():
    from recal_torch import measure_precision

    model, batches, loss = _data()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    layers, left_out = measure_precision(model, batches, loss, scheme="w8a8", prune_levels=(0.5,))
    assert left_out == {}
    by = {layer.name: layer for layer in layers}
    assert list(by) == ["c1", "c2", "dw", "c3", "fc"]
    assert (by["c1"].group, by["c1"].pruned) == ("c1", "outputs")
    assert (by["c2"].group, by["c2"].pruned, by["c2"].in_group) == ("c2", "outputs", "c1")
    assert (by["dw"].group, by["dw"].pruned) == ("c2", "through") and (by["c3"].group, by["c3"].pruned) == ("c2", "inputs")
    assert len(by["c2"].candidates) == 2 * 2 * 2  # two levels of what it makes, two of what it reads, int8 / float
    assert {c.bits for c in by["c1"].candidates} == {8, FLOAT}
    assert by["c2"].conv.spatial == (12, 12) and by["dw"].conv.groups == 32
    half = next(c for c in by["c2"].candidates if c.bits == 8 and c.sparsity == 0.5 and c.in_sparsity == 0.5)
    assert matmul_shape(by["c2"], half) == (1, 8, 16)
    assert half.cost == 16 * 8 * 9 + 16 * 4  # int8 weights and a scale a filter
    dw_half = next(c for c in by["dw"].candidates if c.bits == FLOAT and c.sparsity == 0.5)
    assert matmul_shape(by["dw"], dw_half)[1:] == (16, 16) and dw_half.cost == 4 * 16 * 9
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_the_int8_score_is_the_loss_recals_qat_model_has_with_that_layer_alone_quantized():
    """Scored as the recipe's QuantizationModifier holds the layer at its start (its input, weights and fused output
    quantized, its BatchNorm folded; observers calibrated on the batches in eval mode), everything else float."""
    from recal_torch import ScheduledModifierManager, measure_precision
    from recal_torch.qat import fake_quantizers

    model, batches, _ = _data(1)
    with torch.no_grad():  # the loss: the distance from the float model's logits (0 at float), which int8 moves
        batches = [(b[0], model(b[0])) for b in batches]
    loss = lambda m, b: nn.functional.mse_loss(m(b[0]), b[1])  # noqa: E731
    layers, _ = measure_precision(model, batches, loss, scheme="w8a8")
    for name in ("c2", "fc"):
        score = next(c.score for c in next(la for la in layers if la.name == name).candidates if c.bits == 8)
        others = [la.name for la in layers if la.name != name]
        qat, _, _ = _data(1)
        recipe = ("- !QuantizationModifier {start_epoch: 0.0, ignore: [" + ", ".join(others) + "]}\n"
                  "- !EpochRangeModifier {start_epoch: 0.0, end_epoch: 1.0}\n")
        ScheduledModifierManager(load_recipe(recipe)).modify(qat, torch.optim.SGD(qat.parameters(), lr=0.0), 1)
        assert len(fake_quantizers(getattr(qat, name))) == 3  # input, weights, output: this layer's alone
        qat.eval()
        with torch.no_grad():
            for q in fake_quantizers(qat):
                q.train()  # the observers observe; BatchNorm keeps its running statistics
            for b in batches:
                qat(b[0])
            for q in fake_quantizers(qat):
                q.eval()
            quantized = sum(float(loss(qat, b)) for b in batches) / len(batches)
        assert score == pytest.approx(quantized, rel=1e-4), name
        assert score > 1e-12  # int8 moves the logits: the comparison is not of zeros


def test_a_layer_in_two_groups_takes_each_groups_level_and_the_search_stays_exact():
    """a makes g1, b reads g1 and makes g2, c reads g2: every plan the program may choose gives each group one
    level, and its score is the least of all such plans (brute force)."""
    rng = np.random.default_rng(7)

    def layer(name, group, pruned, in_group=""):
        levels = [(s, t) for s in (0.0, 0.5) for t in ((0.0, 0.5) if in_group else (0.0,))]
        return LayerCandidates(name, 100, tuple(
            Candidate(b, 100 * b / 8 * (1 - s) * (1 - t), float(rng.exponential(1.0)) * (b < FLOAT) + (s + t)
                      * rng.uniform(0.5, 2), sparsity=s, kept=None if not s else 4, in_sparsity=t,
                      in_kept=None if not t else 4)
            for s, t in levels for b in (8, FLOAT)), 8, 8, 1, False, group, pruned, in_group)

    def level(la, c, g):
        return la.levels(c)[g]

    for _ in range(15):
        layers = [layer("a", "g1", "outputs"), layer("b", "g2", "outputs", "g1"), layer("c", "g2", "inputs")]
        budget = float(rng.uniform(*size_bounds(layers)))
        combos = [combo for combo in itertools.product(*(la.candidates for la in layers))
                  if level(layers[0], combo[0], "g1") == level(layers[1], combo[1], "g1")
                  and level(layers[1], combo[1], "g2") == level(layers[2], combo[2], "g2")
                  and sum(c.cost for c in combo) <= budget]
        if not combos:
            continue
        choice = solve(layers, budget)
        assert choice["a"].sparsity == choice["b"].in_sparsity and choice["b"].sparsity == choice["c"].sparsity
        assert sum(c.score for c in choice.values()) == pytest.approx(min(sum(c.score for c in k) for k in combos))


def test_the_planned_cnn_recipe_trains_thins_to_the_plan_and_converts_with_its_float_layers_float(tmp_path):
    import onnx

    from recal_onnx import quantize_qat_export, timed_candidates
    from recal_torch import count_macs, export_onnx, plan_precision

    model, batches, loss = _data(2)
    full = plan_precision(model, batches, loss, scheme="w8a8", loss_budget=1e9)  # the smallest unpruned plan
    assert all(c.bits == 8 for c in full.choice.values())
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always", RuntimeWarning)
        plan = plan_precision(model, batches, loss, scheme="w8a8", budget=0.6 * full.size, prune_levels=(0.5,),
                              timer=timed_candidates, latency_budget=1e3)
    mixed = 0 < sum(c.bits == FLOAT for c in plan.choice.values()) < len(plan.choice)
    assert any("in no layer's time" in str(w.message) for w in said) == mixed  # whichever this CPU's times chose
    assert plan.size <= 0.6 * full.size and plan.latency is not None
    assert "scheme:" not in plan.recipe and "mask_type: filter" in plan.recipe
    load_recipe(plan.recipe)  # what `recal check` reads
    kept = {name: matmul_shape(la, plan.choice[name])[1:] for name, la in zip(plan.choice, plan.layers)}
    train_planned(model, plan.recipe, batches, loss, lr=1e-3, steps=len(batches))
    for name in ("c1", "c2", "c3"):
        conv = getattr(model, name)
        assert (conv.in_channels, conv.out_channels) == kept[name], (name, plan.recipe)
    # the multiply-adds the plan counts (and writes in its comments) are the thinned model's
    planned_macs = sum(macs(layer, plan.choice[layer.name]) for layer in plan.layers)
    assert planned_macs == count_macs(model, torch.randn(2, 3, 12, 12))[0]
    assert "M multiply-adds" in plan.recipe
    path = tmp_path / "planned.onnx"
    export_onnx(model, torch.randn(1, 3, 12, 12), path)
    out = tmp_path / "planned.int8.onnx"
    quantize_qat_export(path, out)
    ops = {n.name: n.op_type for n in onnx.load(out).graph.node}
    floats = [name for name, c in plan.choice.items() if c.bits == FLOAT and name != "fc"]
    convs = sorted(op for op in ops.values() if op in ("Conv", "QLinearConv"))
    assert convs.count("Conv") == len(floats), (floats, ops)
    assert convs.count("QLinearConv") == 4 - len(floats)


def test_int8_and_float_convolutions_are_timed_at_their_geometry(tmp_path, monkeypatch):
    from recal_onnx import timed_candidates
    from recal_torch import measure_precision

    monkeypatch.setenv("RECAL_CACHE", str(tmp_path))
    model, batches, loss = _data()
    layers, _ = measure_precision(model, batches, loss, scheme="w8a8", prune_levels=(0.5,), score="fisher")
    timed = timed_candidates(layers, group_size=0, threads=1)
    assert all(c.latency > 0 for la in timed for c in la.candidates)
    keys = list(__import__("json").loads((tmp_path / "layer_latency.json").read_text()))
    assert any("conv 16x16 kernel (3, 3)" in k and "groups 16" in k for k in keys)  # the depthwise conv, halved
    assert any("qgemm 1x16x4" in k for k in keys)
    assert timed_candidates(layers, group_size=0, threads=1) == timed  # from the cache


def test_recal_plan_scheme_w8a8_writes_the_cnn_recipe_the_api_plans(tmp_path, monkeypatch):
    """``recal plan --scheme w8a8 --prune-levels 0.5``: the recipe ``plan_precision`` writes on the same batches, one
    ``recal check`` reads, its layers said to be int8 or float."""
    from recal_torch import plan_precision

    from tests.support.cli_in_process import run_recal

    model, batches, loss = _data(3)
    torch.save(model.state_dict(), tmp_path / "cnn.pt")
    (tmp_path / "cnnmodels.py").write_text(
        "import torch\nfrom tests.torch.test_int8_plan import Chain\n\n\ndef build():\n    net = Chain()\n"
        "    net.load_state_dict(torch.load('cnn.pt', weights_only=True))\n    return net.eval()\n")
    x, y = torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])
    np.savez(tmp_path / "images.npz", inputs=x.numpy(), labels=y.numpy())
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(__import__("pathlib").Path(__file__).resolve().parents[2]))
    result = run_recal("plan", "--model", "cnnmodels:build", "--data", "images.npz", "--batch-size", "8",
                       "--scheme", "w8a8", "--prune-levels", "0.5", "--budget", "bits=5", "--no-progress")
    assert result.returncode == 0, result.stderr
    expected = plan_precision(model, batches, loss, scheme="w8a8", prune_levels=(0.5,), bits_budget=5.0).recipe
    assert (tmp_path / "plan.yaml").read_text() == expected
    assert run_recal("check", "plan.yaml").returncode == 0
    assert "int8" in result.stdout and "thinned" in result.stdout and "mask_type: filter" in expected


@pytest.mark.slow
def test_a_hugging_face_mobilenet_v2_is_planned_trained_thinned_to_the_plan_and_converted(tmp_path):
    """transformers' MobileNetV2 (TensorFlow-style padding written as pads, ReLU6, depthwise convolutions, residual
    streams): its spaces are found through the pads and depthwise convolutions, a plan at 60% of int8's bytes prunes
    them, and after QAT ``thin`` leaves every convolution with the channels the plan counted."""
    pytest.importorskip("transformers")
    import onnx

    from recal_onnx import quantize_qat_export
    from recal_torch import export_onnx, plan_precision

    from tests.e2e.zoo.test_cnns import hf_mobilenet_v2  # the zoo's: 32x32 images, width 0.35, 3 classes

    torch.manual_seed(0)
    model = hf_mobilenet_v2().eval()
    batches = [(torch.randn(8, 3, 32, 32), torch.randint(0, 3, (8,)))]
    loss = lambda m, b: nn.functional.cross_entropy(m(b[0]), b[1])  # noqa: E731
    with pytest.warns(UserWarning, match="traced on the calibration batch"):
        full = plan_precision(model, batches, loss, scheme="w8a8", loss_budget=1e9, score="fisher")
        plan = plan_precision(model, batches, loss, scheme="w8a8", budget=0.6 * full.size, prune_levels=(0.5,),
                              score="fisher")
    roles = [layer.pruned for layer in plan.layers]
    assert roles.count("through") >= 10 and sum(bool(layer.in_group) for layer in plan.layers) >= 10
    kept = {name: matmul_shape(layer, plan.choice[name])[1:] for name, layer in zip(plan.choice, plan.layers)}
    train_planned(model, plan.recipe, batches, loss, lr=1e-3, steps=2, example_inputs=(batches[0][0][:2],))
    modules = dict(model.named_modules())
    convs = {name: (modules[name].in_channels, modules[name].out_channels) for name in kept
             if isinstance(modules[name], nn.Conv2d)}
    assert convs == {name: kept[name] for name in convs}
    assert sum(a != b for a, b in zip(convs.values(), (full_shape[1:] for full_shape in (
        matmul_shape(layer, next(c for c in layer.candidates if not c.sparsity and not c.in_sparsity))
        for layer in plan.layers if layer.name in convs)))) >= 10  # and it did thin them
    export_onnx(model, batches[0][0][:1], tmp_path / "mobilenet.onnx")
    quantize_qat_export(tmp_path / "mobilenet.onnx", tmp_path / "mobilenet.int8.onnx")
    ops = [n.op_type for n in onnx.load(tmp_path / "mobilenet.int8.onnx").graph.node]
    assert ops.count("QLinearConv") == len(convs)


def test_a_reduce_range_plan_scores_and_writes_7_bit_weights_for_every_layer():
    """``reduce_range=True``: the AVX2 twin's grid (|q| <= 64), the whole model's or none: each int8 layer scored on
    it (a coarser grid: a larger loss increase than 8 bits'), and the recipe trains it (``reduce_range: true``)."""
    from recal_torch import plan_precision

    model, batches, _ = _data(4)
    with torch.no_grad():
        batches = [(b[0], model(b[0])) for b in batches]
    loss = lambda m, b: nn.functional.mse_loss(m(b[0]), b[1])  # noqa: E731
    eight = plan_precision(model, batches, loss, scheme="w8a8", loss_budget=1e9)
    seven = plan_precision(model, batches, loss, scheme="w8a8", loss_budget=1e9, reduce_range=True)
    assert {c.bits for c in seven.choice.values()} == {7} and seven.size == eight.size
    assert sum(c.score for c in seven.choice.values()) > 2 * sum(c.score for c in eight.choice.values()) > 0
    assert "reduce_range: true" in seven.recipe and "reduce_range" not in eight.recipe
    assert "int8, 7-bit weights" in seven.recipe
    assert load_recipe(seven.recipe).modifiers[1].reduce_range
    with pytest.raises(ValueError, match="7-bit weights are a w8a8 plan's"):
        plan_precision(model, batches, loss, loss_budget=1e9, reduce_range=True)


def test_a_cnn_latency_plan_that_mixes_int8_and_float_says_its_time_leaves_out_the_conversions():
    import dataclasses

    from recal_torch import plan_precision

    model, batches, loss = _data(5)

    def timer(layers, **_):  # c1 faster in float; every other layer faster in int8
        return [dataclasses.replace(la, candidates=tuple(dataclasses.replace(
            c, latency=(0.1 if la.name == "c1" else 1.0) if c.bits == FLOAT else 0.5) for c in la.candidates))
            for la in layers]

    with pytest.warns(RuntimeWarning, match=r"keeps 1 of 5 layers float \(c1\) between int8 ones: the Quantize"):
        plan = plan_precision(model, batches, loss, scheme="w8a8", latency_budget=2.1, timer=timer)
    assert plan.choice["c1"].bits == FLOAT and plan.latency <= 2.1
