"""Filter and channel pruning with coupled channels, and thinning: the thinned model computes what the
masked one did, with fewer multiply-adds, on residual, depthwise and flatten-linear nets, float and QAT."""

import copy
import io

import pytest
import torch
from torch import nn

from recal_core import RecipeError
from recal_torch import ScheduledModifierManager, count_macs, fake_quantize_model, thin

from tests.support.torch_models import SmallCNN

from bench.models import BasicBlock, Bottleneck


class ResNetTiny(nn.Module):
    """A stem, a BasicBlock, a downsampling BasicBlock, a Bottleneck, global pool, linear head."""

    def __init__(self):
        super().__init__()
        self.conv1, self.bn1, self.relu = nn.Conv2d(3, 8, 3, 1, 1, bias=False), nn.BatchNorm2d(8), nn.ReLU()
        self.blocks = nn.Sequential(BasicBlock(8, 8, 1), BasicBlock(8, 16, 2), Bottleneck(16, 4, 1))
        self.fc = nn.Linear(16, 5)

    def forward(self, x):
        x = self.blocks(self.relu(self.bn1(self.conv1(x))))
        return self.fc(x.mean((2, 3)))


class MobileTiny(nn.Module):
    """MobileNetV2-style: expand 1x1, depthwise 3x3, project 1x1 with a residual add, flatten, linear."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, 1, 1, bias=False), nn.BatchNorm2d(8), nn.ReLU6())
        self.expand = nn.Sequential(nn.Conv2d(8, 24, 1, bias=False), nn.BatchNorm2d(24), nn.ReLU6())
        self.dw = nn.Sequential(nn.Conv2d(24, 24, 3, 1, 1, groups=24, bias=False), nn.BatchNorm2d(24), nn.ReLU6())
        self.project = nn.Sequential(nn.Conv2d(24, 8, 1, bias=False), nn.BatchNorm2d(8))
        self.pool = nn.AdaptiveAvgPool2d(2)
        self.fc = nn.Linear(8 * 4, 5)

    def forward(self, x):
        x = self.stem(x)
        x = x + self.project(self.dw(self.expand(x)))
        return self.fc(torch.flatten(self.pool(x), 1))


def _recipe(params, kind, sparsity=0.5):
    return f"""
- !EpochRangeModifier {{start_epoch: 0, end_epoch: 4}}
- !GradualKSModifier {{params: {params}, init_sparsity: 0.0, final_sparsity: {sparsity}, start_epoch: 0,
                      end_epoch: 2, update_frequency: 1, mask_type: {kind}}}
- !QuantizationModifier {{start_epoch: 3}}
"""


def _train(model, recipe, steps=16, shape=(3, 16, 16), qat=False):
    manager = ScheduledModifierManager.from_yaml(recipe if qat else recipe.rsplit("- !Quant", 1)[0])
    optimizer = manager.modify(model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                               steps_per_epoch=4)
    _steps(model, optimizer, steps, shape, seed=0)
    manager.finalize()
    return manager


CASES = {
    "resnet-filter": (ResNetTiny, "['re:.*conv\\d', 're:.*down.0', conv1]", "filter", (3, 16, 16)),
    "resnet-channel": (ResNetTiny, "['re:blocks.*conv\\d', 're:.*down.0', fc]", "channel", (3, 16, 16)),
    "mobile-filter": (MobileTiny, "[stem.0, expand.0, project.0]", "filter", (3, 8, 8)),
    "smallcnn-filter": (lambda: SmallCNN(width=8), "[conv1, conv2, conv3]", "filter", (1, 8, 8)),
    "smallcnn-channel": (lambda: SmallCNN(width=8), "[conv2, conv3, fc]", "channel", (1, 8, 8)),
}


@pytest.mark.parametrize("qat", [False, True], ids=["float", "qat"])
@pytest.mark.parametrize("case", CASES)
def test_thinned_model_computes_what_the_masked_one_did(case, qat):
    make, params, kind, shape = CASES[case]
    torch.manual_seed(0)
    model = make()
    _train(model, _recipe(params, kind), steps=16, shape=shape, qat=qat)
    model.eval()
    x = torch.randn(4, *shape, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = model(x)
    macs, n_params = count_macs(model, x)
    thinned = copy.deepcopy(model)
    report = thin(thinned)
    macs_after, params_after = count_macs(thinned, x)
    print(f"{case} {'qat' if qat else 'float'}: {report.removed} channels removed, MACs {macs} -> {macs_after}, "
          f"params {n_params} -> {params_after}")
    assert report.removed > 0 and macs_after < 0.8 * macs and params_after < n_params
    with torch.no_grad():
        got = thinned(x)
    scale = expected.abs().max().item()
    tolerance = 1e-5 * scale if not qat else 1e-5 * scale + 2 * _output_step(thinned)
    assert torch.allclose(got, expected, atol=tolerance, rtol=0), (got - expected).abs().max()


def _output_step(model):
    """One quantization step of the model's last QAT output (float rounding can flip one)."""
    last = [m for m in model.modules() if hasattr(m, "activation_post_process")][-1]
    return float(last.activation_post_process.scale)


def test_coupled_layers_prune_the_same_channels_and_followers_are_zero():
    torch.manual_seed(0)
    model = ResNetTiny()
    _train(model, _recipe(CASES["resnet-filter"][1], "filter"))
    rows = lambda w: (w.flatten(1) == 0).all(1)  # noqa: E731
    stem, block0 = rows(model.conv1.weight), rows(model.blocks[0].conv2.weight)
    assert torch.equal(stem, block0) and int(stem.sum()) == 4  # 50% of 8, one ranking for the residual stream
    assert torch.all(model.bn1.bias[stem] == 0) and torch.all(model.bn1.running_mean[stem] == 0)
    down, block1 = rows(model.blocks[1].down[0].weight), rows(model.blocks[1].conv2.weight)
    assert torch.equal(down, block1) and int(down.sum()) == 8


@pytest.mark.parametrize("params, words", [
    ("[conv1]", "blocks.0.conv2 adds its output to conv1"),
    ("['re:.*conv\\d', conv1]", "blocks.1.down.0 adds its output to"),
    ("[fc]", "the model's output"),
])
def test_filter_pruning_a_layer_whose_channels_cannot_drop_is_a_located_error(params, words):
    model = ResNetTiny()
    manager = ScheduledModifierManager.from_yaml(_recipe(params, "filter").rsplit("- !Quant", 1)[0])
    with pytest.raises(RecipeError, match=r"<string>:4:\d+: .*field 'mask_type'") as err:
        manager.modify(model, torch.optim.SGD(model.parameters(), lr=0.1), steps_per_epoch=4)
    assert words in str(err.value), str(err.value)


def test_a_reshape_the_rules_do_not_cover_blocks_filter_pruning():
    class Reshaped(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 8, 3)
            self.fc = nn.Linear(8 * 36, 2)

        def forward(self, x):
            return self.fc(self.conv(x).view(x.shape[0], -1))

    model = Reshaped()
    manager = ScheduledModifierManager.from_yaml(_recipe("[conv]", "filter").rsplit("- !Quant", 1)[0])
    with pytest.raises(RecipeError, match=r"conv: mask_type filter: its output channels \(filters\) also reach view"):
        manager.modify(model, torch.optim.SGD(model.parameters(), lr=0.1), steps_per_epoch=4)


def test_a_model_fx_cannot_trace_is_a_located_error_for_filter_pruning():
    class Branchy(SmallCNN):
        def forward(self, x):
            return super().forward(x) if x.shape[1] == 1 else -super().forward(x)  # control flow on a shape

    model = Branchy()
    manager = ScheduledModifierManager.from_yaml(_recipe("[conv1, conv2, conv3]", "filter").rsplit("- !Quant", 1)[0])
    with pytest.raises(RecipeError, match=r"<string>:4:\d+: .*field 'mask_type': structured pruning reads the "
                                          r"model's graph .* and cannot: .*TraceError.*pass example_inputs="):
        manager.modify(model, torch.optim.SGD(model.parameters(), lr=0.1), steps_per_epoch=4)
    # with example inputs, torch.export traces the branch their shape takes, and the coupling is found
    manager = ScheduledModifierManager.from_yaml(_recipe("[conv1, conv2, conv3]", "filter").rsplit("- !Quant", 1)[0])
    manager.modify(model, torch.optim.SGD(model.parameters(), lr=0.1), steps_per_epoch=4,
                   example_inputs=torch.ones(2, 1, 8, 8))
    traced = ScheduledModifierManager.from_yaml(_recipe("[conv1, conv2, conv3]", "filter").rsplit("- !Quant", 1)[0])
    plain = SmallCNN()
    traced.modify(plain, torch.optim.SGD(plain.parameters(), lr=0.1), steps_per_epoch=4)  # torch.fx's groups
    assert manager.plan.channel_groups == traced.plan.channel_groups
    assert [sorted(g.members) for g in manager.plan.channel_groups] == [["conv1.weight", "conv2.weight"],
                                                                        ["conv3.weight"]]


def test_thin_leaves_a_dense_model_alone_and_qat_fake_quant_follows():
    model = ResNetTiny()
    assert thin(copy.deepcopy(model)).removed == 0
    fake_quantize_model(model)
    assert thin(model).removed == 0


@pytest.mark.filterwarnings("ignore:left in float:UserWarning")  # ReLU6 and mean-pool: issue 11's coverage
@pytest.mark.parametrize("case", ["resnet-filter", "mobile-filter", "smallcnn-channel"])
def test_quantize_qat_export_thins_a_masked_export_as_thin_does(case, tmp_path):
    import numpy as np
    import onnxruntime as ort

    from recal_onnx import quantize_qat_export
    from recal_torch import export_onnx

    make, params, kind, shape = CASES[case]
    torch.manual_seed(0)
    model = make()
    _train(model, _recipe(params, kind), shape=shape, qat=True)
    model.eval()
    export_onnx(model, torch.randn(1, *shape), tmp_path / "qat.onnx", dynamo=False)
    feeds = {"input": torch.randn(8, *shape, generator=torch.Generator().manual_seed(2)).numpy()}
    thinned = quantize_qat_export(tmp_path / "qat.onnx", tmp_path / "thin.onnx", inputs=feeds, channel_block=1)
    quantize_qat_export(tmp_path / "qat.onnx", tmp_path / "full.onnx", inputs=feeds, thin=False)
    assert thinned.rewrites["thin_channels"] == thin(copy.deepcopy(model)).removed > 0
    outputs = [ort.InferenceSession(str(tmp_path / f"{n}.onnx")).run(None, feeds)[0] for n in ("thin", "full")]
    step = _output_step(model)
    assert np.abs(outputs[0] - outputs[1]).max() <= step + 1e-6  # at most one quantum: summation order
    assert (tmp_path / "thin.onnx").stat().st_size < (tmp_path / "full.onnx").stat().st_size


def test_resuming_from_a_checkpoint_masks_the_followers_again():
    """After optimizer.load_state_dict the group masks come back, and with them the BatchNorm shifts' masks."""
    torch.manual_seed(0)
    model = ResNetTiny()
    recipe = _recipe(CASES["resnet-filter"][1], "filter").rsplit("- !Quant", 1)[0]
    manager = ScheduledModifierManager.from_yaml(recipe)
    optimizer = manager.modify(model, torch.optim.SGD(model.parameters(), lr=0.05), steps_per_epoch=4)
    _steps(model, optimizer, 8)
    optimizer_state, model_state = optimizer.state_dict(), copy.deepcopy(model.state_dict())
    pruned = (model.conv1.weight == 0).flatten(1).all(1)
    assert int(pruned.sum()) == 4

    resumed = ResNetTiny()
    resumed.load_state_dict(model_state)
    with torch.no_grad():
        resumed.bn1.bias.add_(1.0)  # as if the shifts had drifted: the restored masks zero them again
    again = ScheduledModifierManager.from_yaml(recipe)
    opt2 = again.modify(resumed, torch.optim.SGD(resumed.parameters(), lr=0.05), steps_per_epoch=4)
    opt2.load_state_dict(optimizer_state)
    _steps(resumed, opt2, 1)
    assert torch.equal((resumed.conv1.weight == 0).flatten(1).all(1), pruned)
    assert torch.all(resumed.bn1.bias[pruned] == 0) and torch.all(resumed.bn1.running_mean[pruned] == 0)


def _steps(model, optimizer, n, shape=(3, 16, 16), seed=3):
    """``n`` steps of cross-entropy on random batches of 8 (5 classes)."""
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(torch.randn(8, *shape, generator=g)),
                                    torch.randint(0, 5, (8,), generator=g)).backward()
        optimizer.step()


@pytest.mark.parametrize("case", sorted(CASES))
def test_torch_export_finds_the_spaces_torch_fx_finds(case):
    from recal_torch.tracing import model_graph

    build, _, _, shape = CASES[case]
    model = build()

    def spaces(graph):
        return sorted((tuple(p.weight for p in s.producers), tuple(c.weight for c, _ in s.consumers),
                       tuple(sorted(t for _, ts in s.followers for t in ts)), s.thinnable) for s in graph.spaces
                      if s.producers)

    assert spaces(model_graph(model, torch.ones(2, *shape))) == spaces(model_graph(model))


def test_load_thinned_takes_only_thinning_and_changes_nothing_when_it_refuses():
    """Only removal along the axes thinning removes is loaded (a 3x3 kernel as 5x5, or a larger layer, is refused,
    naming the layer and axis, before anything is allocated); a refusal at any point leaves the model as built."""
    from recal_torch import load_thinned

    def net():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.ReLU(),
                                   torch.nn.Conv2d(8, 4, 3, padding=1))

    dense = net()
    before = {k: v.clone() for k, v in dense.state_dict().items()}
    bad_kernel = dict(dense.state_dict(), **{"0.weight": torch.zeros(8, 3, 5, 5)})
    with pytest.raises(ValueError, match=r"0\.weight \(Conv2d\).*axis 2 \(3 -> 5\)|0\.weight \(Conv2d\) is larger"):
        load_thinned(dense, bad_kernel)
    wider = dict(dense.state_dict(), **{"3.weight": torch.zeros(4, 16, 3, 3)})
    with pytest.raises(ValueError, match=r"3\.weight \(Conv2d\) is larger along axis 1"):
        load_thinned(dense, wider)
    expanded = io.BytesIO()  # a 1 kB checkpoint whose tensor claims 3.6 GB (stride 0): refused before a copy
    torch.save(dict(dense.state_dict(), **{"3.weight": torch.zeros(1).expand(4, 10**8, 3, 3)}), expanded)
    expanded.seek(0)
    with pytest.raises(ValueError, match=r"3\.weight \(Conv2d\) is larger along axis 1"):
        load_thinned(dense, torch.load(expanded, weights_only=True))
    thinned = {k: v[:6] if k.startswith(("0.", "1.")) and v.dim() >= 1 and k != "1.num_batches_tracked" else v
               for k, v in dense.state_dict().items()}
    thinned["3.weight"] = dense.state_dict()["3.weight"][:, :6]
    missing = {k: v for k, v in thinned.items() if k != "3.bias"}  # passes the shape check, fails the strict load
    with pytest.raises(ValueError, match=r"missing \['3.bias'\].*nothing was loaded"):
        load_thinned(dense, missing)
    extra = dict(thinned, unexpected=torch.zeros(1))  # the unthinned layers' tensors would be copied, then refused
    with pytest.raises(ValueError, match=r"unexpected \['unexpected'\].*nothing was loaded"):
        load_thinned(dense, extra)
    assert dense[0].out_channels == 8 and dense[1].num_features == 8 and dense[3].in_channels == 8
    assert all(torch.equal(v, before[k]) for k, v in dense.state_dict().items())
    load_thinned(dense, thinned)  # the real thing still loads
    assert dense[0].out_channels == 6 and dense(torch.randn(1, 3, 5, 5)).shape == (1, 4, 5, 5)


@pytest.mark.parametrize("traced_by", ["fx", "export"])
def test_filter_pruning_and_qat_in_one_recipe_thin_whichever_trace(traced_by):
    """Conv-BatchNorm layers under QAT (the BatchNorm folded into the fake-quantized weight, undone before it)
    with filter pruning in the same recipe: ``thin`` finds the dead filters through torch.fx and through
    torch.export on the inputs given to ``modify`` (kept for it), and the thinned model computes the same."""

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.c1, self.b1 = nn.Conv2d(1, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8)
            self.c2, self.b2 = nn.Conv2d(8, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8)
            self.fc = nn.Linear(8, 4)

        def forward(self, x):
            x = torch.relu(self.b2(self.c2(torch.relu(self.b1(self.c1(x))))))
            return self.fc(x.mean((2, 3)))

    torch.manual_seed(0)
    model, x = Net(), torch.randn(4, 1, 8, 8)
    _filters_and_qat_trained(model, "[c1.weight, c2.weight]", x, example_inputs=x if traced_by == "export" else None)
    with torch.no_grad():
        before = model(x)
    report = thin(model)
    assert [after for _, _, after in report.spaces] == [4, 4], str(report)
    with torch.no_grad():
        torch.testing.assert_close(model(x), before, atol=1e-6, rtol=0)


def _filters_and_qat_trained(model, params: str, x, example_inputs=None) -> None:
    """Four steps under half of ``params``' filters pruned and QAT from the start, finalized, in eval mode."""
    manager = ScheduledModifierManager.from_yaml(
        f"- !GradualKSModifier {{params: {params}, init_sparsity: 0.5, final_sparsity: 0.5, start_epoch: 0, "
        "end_epoch: 1, update_frequency: 1, mask_type: filter}\n- !QuantizationModifier {start_epoch: 0}\n")
    optimizer = manager.modify(model, torch.optim.SGD(model.parameters(), lr=0.01), steps_per_epoch=2,
                               example_inputs=example_inputs)
    for _ in range(4):
        optimizer.zero_grad()
        model(x).sum().backward()
        optimizer.step()
    manager.finalize(model)
    model.eval()


class _PaddedDepthwise(nn.Module):
    """TensorFlow-style padding written as a pad before each convolution (transformers' MobileNetV2), ReLU6 as
    torch.export writes it, a depthwise convolution between two others; ``channel_pad`` pads the channel axis too."""

    def __init__(self, channel_pad=False):
        super().__init__()
        self.a, self.bn = nn.Conv2d(3, 8, 3, bias=False), nn.BatchNorm2d(8)  # a conv before a BatchNorm
        self.dw, self.b = nn.Conv2d(8, 8, 3, groups=8), nn.Conv2d(8 + 2 * channel_pad, 4, 1)
        self.pad = (0, 0, 0, 0, 1, 1) if channel_pad else (0, 0, 0, 0)

    def forward(self, x):
        x = nn.functional.relu6(self.bn(self.a(nn.functional.pad(x, (1, 1, 1, 1)))))
        return self.b(nn.functional.pad(self.dw(nn.functional.pad(x, (1, 1, 1, 1))), self.pad))


def test_a_space_through_image_pads_and_relu6_thins_and_a_channel_pad_does_not():
    torch.manual_seed(0)
    x = torch.randn(2, 3, 8, 8)
    for channel_pad in (False, True):
        model = _PaddedDepthwise(channel_pad).eval()
        with torch.no_grad():  # channels 0-3 dead: the filters and what follows them zero, as a filter mask leaves them
            for tensor in (model.a.weight, model.bn.bias, model.bn.running_mean, model.dw.weight, model.dw.bias):
                tensor[:4] = 0
            before = model(x)
        thin(model, example_inputs=(x,))
        expected = 8 if channel_pad else 4  # zeros padded into the channels: the channels shift, nothing thins
        assert (model.a.out_channels, model.dw.out_channels) == (expected, expected), channel_pad
        with torch.no_grad():
            torch.testing.assert_close(model(x), before, atol=1e-5, rtol=0)


def test_a_qat_model_thins_through_image_pads_relu6_and_a_depthwise_convolution():
    """Under QAT the ReLU6 is fused into the convolution's forward (``aten.relu6`` in torch.export's graph, not the
    ``hardtanh`` a float ReLU6 becomes): the space still runs through it."""
    torch.manual_seed(0)
    model, x = _PaddedDepthwise(), torch.randn(4, 3, 8, 8)
    _filters_and_qat_trained(model, "[a.weight]", x, example_inputs=(x,))
    with torch.no_grad():
        before = model(x)
    thin(model)
    assert (model.a.out_channels, model.dw.out_channels, model.b.in_channels) == (4, 4, 4)
    with torch.no_grad():
        torch.testing.assert_close(model(x), before, atol=1e-5, rtol=0)
