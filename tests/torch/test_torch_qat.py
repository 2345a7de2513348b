"""PyTorch QAT: numbers against a numpy reference, fusion, sparsity through QAT, resume, export."""

import warnings

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from torch import nn

from recal_core.schedules import pruned_count
from recal_torch import QATConv, QATLinear, ScheduledModifierManager, export_onnx, fake_quantize_model
from recal_torch.export import to_export_model
from recal_torch.qat import ActivationFakeQuantize, FoldedBatchNorm, QuantizedReLU, WeightFakeQuantize

from tests.support.onnx_graphs import assert_biases_on_grid
from tests.support.torch_models import SmallCNN, assert_same_state, batches, load_checkpoint, train_steps
from tests.e2e.zoo.library_patterns import StochasticDepth

SPE = 4
PRUNE_QAT = """
- !EpochRangeModifier {start_epoch: 0, end_epoch: 5}
- !GradualKSModifier {params: __ALL_PRUNABLE__, init_sparsity: 0.2, final_sparsity: 0.7, start_epoch: 0,
                      end_epoch: 2, update_frequency: 0.5}
- !QuantizationModifier {start_epoch: 2.5, freeze_bn_stats_epoch: 3.5, disable_quantization_observer_epoch: 4}
- !SetLearningRateModifier {start_epoch: 2.5, learning_rate: 0.01}
"""


def np_fake_quant(x, scale, zero_point, qmin, qmax, axis=None):
    x = np.asarray(x, dtype=np.float32)
    if axis is not None:
        shape = [1] * x.ndim
        shape[axis] = -1
        scale = np.asarray(scale, np.float32).reshape(shape)
        zero_point = np.asarray(zero_point).reshape(shape)
    scale = np.asarray(scale, dtype=np.float32)
    inv_scale = (np.float32(1.0) / scale).astype(np.float32)  # torch multiplies by the float32 inverse
    q = np.clip(np.rint(x * inv_scale) + zero_point, qmin, qmax)
    return ((q - zero_point) * scale).astype(np.float32)


def test_activation_fake_quant_matches_numpy():
    torch.manual_seed(0)
    fq = ActivationFakeQuantize(averaging_constant=0.1)
    xs = [torch.randn(64) * 3 + 1 for _ in range(3)]
    lo, hi = float(xs[0].min()), float(xs[0].max())
    for x in xs[1:]:
        fq(xs[0]) if lo is None else None
        break
    fq = ActivationFakeQuantize(averaging_constant=0.1)
    lo = hi = None
    for x in xs:
        out = fq(x)
        xl, xh = float(x.min()), float(x.max())
        lo, hi = (xl, xh) if lo is None else (lo + 0.1 * (xl - lo), hi + 0.1 * (xh - hi))
        lo_neg, hi_pos = min(lo, 0.0), max(hi, 0.0)
        scale = np.float32((hi_pos - lo_neg) / 255)
        zp = int(np.clip(0 - np.rint(lo_neg / scale), 0, 255))
        assert float(fq.scale) == pytest.approx(scale, rel=1e-5) and int(fq.zero_point) == zp
        np.testing.assert_allclose(out.numpy(), np_fake_quant(x.numpy(), float(fq.scale), zp, 0, 255), atol=1e-6)
    fq.eval()
    before = float(fq.scale)
    fq(torch.randn(64) * 100)
    assert float(fq.scale) == before  # eval mode does not observe


def test_weight_fake_quant_is_symmetric_per_channel_and_keeps_zeros():
    torch.manual_seed(0)
    w = torch.randn(4, 3, 3, 3)
    w[0, 0] = 0
    fq = WeightFakeQuantize(4)
    out = fq(w)
    scale = w.abs().flatten(1).amax(1).numpy() / 127
    np.testing.assert_allclose(fq.scale.numpy(), scale, rtol=1e-6)
    np.testing.assert_allclose(out.numpy(), np_fake_quant(w.numpy(), scale, np.zeros(4), -128, 127, axis=0), atol=1e-6)
    assert torch.all(out[0, 0] == 0)
    q = np.rint(w.numpy() / scale.reshape(-1, 1, 1, 1))
    assert q.max() <= 127 and q.min() >= -127


def test_a_nearly_dead_channel_keeps_a_grid_its_bias_fits_and_every_conv_converts(tmp_path):
    """A pretrained filter trained nearly dead (max|w| 5e-7 beside 0.3: RapidOCR's recognizer has one) with a bias
    of -0.65: at a scale of max|w| / 127 its int32 bias is 3e9 steps, beyond int32, and the converter must leave
    the conv float. Its scale is held at 1/4096 of the layer's largest, so the bias fits and the conv is integer."""
    from recal_onnx import quantize_qat_export
    from recal_torch.qat.quantizers import CHANNEL_SPAN, weight_qparams

    torch.manual_seed(0)
    w = torch.randn(4, 3, 3, 3) * 0.1
    w[2] = torch.randn(3, 3, 3) * 1e-7
    scale, _ = weight_qparams(w)
    assert float(scale[2]) == pytest.approx(float(scale.max()) / CHANNEL_SPAN)
    assert torch.equal(scale[[0, 1, 3]], w[[0, 1, 3]].abs().flatten(1).amax(1) / 127)
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 2, 1))
    with torch.no_grad():
        model[0].weight.copy_(w)
        model[0].bias.copy_(torch.tensor([0.1, -0.2, -0.65, 0.3]))
    fake_quantize_model(model)
    x = torch.randn(16, 3, 8, 8, generator=torch.Generator().manual_seed(1))
    model.train()
    model(x)
    model.eval()
    path = export_onnx(model, x[:2], tmp_path / "qat.onnx", dynamo=False)
    result = quantize_qat_export(str(path), tmp_path / "int8.onnx", verify_inputs={"input": x.numpy()})
    assert not result.float_reasons and result.float_ops == {}, result.float_reasons
    ops = {n.op_type for n in onnx.load(str(result.path)).graph.node}
    assert "QLinearConv" in ops and "Conv" not in ops


def test_fake_quantize_model_fuses_conv_bn_relu_in_place_and_keeps_parameters():
    torch.manual_seed(0)
    model = SmallCNN()
    params_before = {n: p for n, p in model.named_parameters()}
    created = fake_quantize_model(model)
    assert isinstance(model.conv1, QATConv) and isinstance(model.bn1, FoldedBatchNorm)
    assert isinstance(model.relu1, nn.Identity)  # fused
    assert isinstance(model.conv2, QATConv) and isinstance(model.relu2, QuantizedReLU)  # quantizes the residual sum
    assert isinstance(model.conv3, QATConv) and model.conv3.relu and isinstance(model.fc, QATLinear)
    assert len(created) == 4
    # same Parameter objects under the same names
    assert {n: p for n, p in model.named_parameters()} == params_before
    # conv1 quantizes the model input; conv2's input is conv1's quantized output; conv3 follows max-pool of
    # the quantized residual sum; fc follows average pooling, which changes values, so it quantizes its input
    assert model.conv1.input_fake_quant is not None and model.conv2.input_fake_quant is None
    assert model.conv3.input_fake_quant is None and model.fc.input_fake_quant is not None


def test_qat_conv_bn_eval_equals_folded_float_computation():
    torch.manual_seed(0)
    model = SmallCNN()
    train_steps(model, torch.optim.SGD(model.parameters(), lr=0.01), batches(3))
    reference = SmallCNN()
    reference.load_state_dict(model.state_dict())
    fake_quantize_model(model)
    model.train()
    for x, _ in batches(5, seed=1):
        model(x)  # observers see data
    model.eval()
    x = batches(1, seed=2)[0][0]
    conv = model.conv1
    w, b = conv.folded_weight_and_bias()
    scale = (w.detach().abs().flatten(1).amax(1) / 127).numpy()  # the observer follows the folded weight
    wq = np_fake_quant(w.detach().numpy(), scale, np.zeros_like(scale), -128, 127, axis=0)
    xin = np_fake_quant(x.numpy(), float(conv.input_fake_quant.scale), int(conv.input_fake_quant.zero_point), 0, 255)
    y = nn.functional.conv2d(torch.from_numpy(xin), torch.from_numpy(wq), b, padding=1).clamp(min=0)
    post = conv.activation_post_process
    expected = np_fake_quant(y.detach().numpy(), float(post.scale), int(post.zero_point), 0, 255)
    with torch.no_grad():
        got = conv(x)
    # equal up to float rounding: at most one quantum, at rare rounding boundaries
    assert np.abs(got.numpy() - expected).max() <= float(post.scale) * 1.001
    assert (np.abs(got.numpy() - expected) > 1e-5).mean() < 0.01


def _run_prune_qat(stop=None, seed=0, opt="sgd"):
    torch.manual_seed(seed)
    model = SmallCNN()
    manager = ScheduledModifierManager.from_yaml(PRUNE_QAT)
    inner = (torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9) if opt == "sgd"
             else torch.optim.Adam(model.parameters(), lr=0.005))
    optimizer = manager.modify(model, inner, steps_per_epoch=SPE)
    return model, manager, optimizer


def test_qat_switch_keeps_optimizer_state_and_sparsity():
    model, manager, optimizer = _run_prune_qat(opt="adam")
    data = batches(20)
    weight = model.conv2.weight
    start = manager.schedule.step(2.5)
    train_steps(model, optimizer, data, stop=start - 1)
    assert not isinstance(model.conv2, QATConv)
    exp_avg = optimizer.state[weight]["exp_avg"].clone()
    train_steps(model, optimizer, data, start=start - 1, stop=start)
    assert isinstance(model.conv2, QATConv) and model.conv2.weight is weight
    assert not torch.equal(optimizer.state[weight]["exp_avg"], exp_avg)  # same state entry kept updating
    assert optimizer.param_groups[0]["lr"] == 0.01
    train_steps(model, optimizer, data, start=start, stop=manager.max_epochs * SPE)
    for name in ("conv1", "conv2", "conv3", "fc"):
        w = getattr(model, name).weight
        assert int((w == 0).sum()) == pruned_count(0.7, w.numel()), name
    assert model.conv2.bn_frozen and not model.conv2.activation_post_process.observer_enabled
    exported = to_export_model(model)
    for name in ("conv1", "conv2", "conv3", "fc"):
        q = getattr(exported, name).weight_int8
        assert torch.equal(q == 0, getattr(model, name).weight == 0) or bool(
            torch.all(q[getattr(model, name).weight == 0] == 0)), name


def test_observers_and_bn_freeze_at_their_epochs():
    model, manager, optimizer = _run_prune_qat()
    data = batches(20)
    seen = {}

    def record(k):
        if isinstance(model.conv2, QATConv):
            seen[k] = (model.conv2.bn_frozen, model.conv2.activation_post_process.observer_enabled)

    train_steps(model, optimizer, data, stop=manager.max_epochs * SPE, after_step=record)
    assert min(seen) == 10  # 2.5 epochs * 4
    assert seen[13] == (False, True) and seen[14] == (True, True) and seen[16] == (True, False)


def _checkpoint(model, optimizer):
    import copy

    return copy.deepcopy({"model": model.state_dict(), "optimizer": optimizer.state_dict()})


@pytest.mark.parametrize("resume_at", [3, 6, 11, 15])
def test_resume_is_bit_identical(resume_at):
    data = batches(24)
    total = 5 * SPE
    model_a, manager_a, opt_a = _run_prune_qat()
    ckpt = {}
    train_steps(model_a, opt_a, data, stop=total,
                after_step=lambda k: ckpt.update(_checkpoint(model_a, opt_a)) if k == resume_at else None)
    import copy
    ckpt = copy.deepcopy(ckpt)

    model_b, manager_b, opt_b = _run_prune_qat(seed=123)  # different init: everything must come from ckpt
    opt_b.load_state_dict(ckpt["optimizer"])  # restores recal state first (re-creates QAT modules)
    model_b.load_state_dict(ckpt["model"])
    assert manager_b.step == resume_at
    train_steps(model_b, opt_b, data, start=resume_at, stop=total)
    assert_same_state(model_a, model_b)
    assert opt_a.param_groups[0]["lr"] == opt_b.param_groups[0]["lr"]
    for name in manager_a.masks.effective:
        assert torch.equal(manager_a.masks.effective[name], manager_b.masks.effective[name])


def test_resume_refuses_other_recipe_or_steps():
    model, manager, optimizer = _run_prune_qat()
    state = manager.state_dict()
    other = ScheduledModifierManager.from_yaml(PRUNE_QAT.replace("0.7", "0.6"))
    m = SmallCNN()
    other.modify(m, torch.optim.SGD(m.parameters(), lr=0.1), steps_per_epoch=SPE)
    with pytest.raises(ValueError, match="different recipe"):
        other.load_state_dict(state)
    again = ScheduledModifierManager.from_yaml(PRUNE_QAT)
    m = SmallCNN()
    again.modify(m, torch.optim.SGD(m.parameters(), lr=0.1), steps_per_epoch=SPE + 1)
    with pytest.raises(ValueError, match="steps_per_epoch"):
        again.load_state_dict(state)


def _trained_qat_model():
    model, manager, optimizer = _run_prune_qat()
    train_steps(model, optimizer, batches(24), stop=manager.max_epochs * SPE)
    manager.finalize(model)
    return model.eval()


@pytest.fixture(scope="module")
def qat_model():
    return _trained_qat_model()


@pytest.mark.parametrize("dynamo", [True, False])
def test_qat_export_matches_pytorch_in_onnxruntime(qat_model, dynamo, tmp_path):
    path = export_onnx(qat_model, torch.randn(1, 1, 8, 8), tmp_path / "qat.onnx", dynamo=dynamo)
    model = onnx.load(str(path))
    onnx.checker.check_model(model)
    ops = [n.op_type for n in model.graph.node]
    assert "BatchNormalization" not in ops and ops.count("QuantizeLinear") >= 4
    # every Conv reads dequantized input and weight and feeds a QuantizeLinear (directly or via Relu)
    producers = {o: n for n in model.graph.node for o in n.output}
    consumers = {}
    for n in model.graph.node:
        for i in n.input:
            consumers.setdefault(i, []).append(n)
    def source(name):  # through ops that keep quantized values (runtimes propagate DQ over them)
        node = producers[name]
        while node.op_type in ("MaxPool", "Relu", "Reshape", "Flatten"):
            node = producers[node.input[0]]
        return node.op_type

    for conv in (n for n in model.graph.node if n.op_type == "Conv"):
        assert source(conv.input[0]) == "DequantizeLinear"
        assert producers[conv.input[1]].op_type == "DequantizeLinear"
        nxt = consumers[conv.output[0]][0]
        if nxt.op_type == "Relu":
            nxt = consumers[nxt.output[0]][0]
        assert nxt.op_type in ("QuantizeLinear",), nxt.op_type
    session = ort.InferenceSession(str(path))  # default optimization level
    x = torch.randn(1000, 1, 8, 8, generator=torch.Generator().manual_seed(3))
    got = session.run(None, {"input": x.numpy()})[0]
    with torch.no_grad():
        ref = qat_model(x).numpy()
    agreement = float((got.argmax(1) == ref.argmax(1)).mean())
    max_diff = float(np.abs(got - ref).max())
    print(f"dynamo={dynamo}: argmax agreement {agreement:.4f}, max abs diff {max_diff:.5f}")
    assert agreement >= 0.995
    assert list(tmp_path.iterdir()) == [path]


def test_float_export_keeps_pruned_zeros(tmp_path):
    from onnx import numpy_helper

    torch.manual_seed(0)
    model = SmallCNN()
    manager = ScheduledModifierManager.from_yaml("- !GradualKSModifier {params: [fc], init_sparsity: 0.5, "
                                                 "final_sparsity: 0.5, start_epoch: 0, end_epoch: 1, update_frequency: 1}")
    manager.modify(model, torch.optim.SGD(model.parameters(), lr=0.1), steps_per_epoch=1)
    model.eval()
    path = export_onnx(model, torch.randn(2, 1, 8, 8), tmp_path / "f.onnx", dynamo=False)
    weights = [numpy_helper.to_array(t) for t in onnx.load(str(path)).graph.initializer]
    fc = next(w for w in weights if w.shape == (10, 8))
    assert int((fc == 0).sum()) == 40
    session = ort.InferenceSession(str(path))
    x = torch.randn(5, 1, 8, 8)
    np.testing.assert_allclose(session.run(None, {"input": x.numpy()})[0], model(x).detach().numpy(), atol=1e-5)


def test_export_failure_leaves_no_file(tmp_path):
    class Broken(nn.Module):
        def forward(self, x):
            raise RuntimeError("boom")

    target = tmp_path / "m.onnx"
    with pytest.raises(Exception):
        export_onnx(Broken(), torch.randn(1, 2), target, dynamo=False)
    assert list(tmp_path.iterdir()) == []


def test_fresh_quantizers_pass_values_through_and_refuse_export(tmp_path):
    torch.manual_seed(0)
    model = SmallCNN()
    fake_quantize_model(model)
    model.eval()
    x = torch.randn(4, 1, 8, 8)
    reference = SmallCNN()
    torch.manual_seed(0)
    reference = SmallCNN().eval()
    # no observation yet: activations are not quantized (weights are), so outputs stay close to float
    assert torch.allclose(model(x), reference(x), atol=0.05)
    with pytest.raises(ValueError, match="has not observed any data"):
        export_onnx(model, x[:1], tmp_path / "m.onnx", dynamo=False)
    assert not list(tmp_path.iterdir())


IGNORE = """
- !EpochRangeModifier {start_epoch: 0, end_epoch: 2}
- !QuantizationModifier
    start_epoch: 0
    ignore: %s
    scheme_overrides: %s
"""


def _qat_with(ignore, overrides, model=None):
    model = model or SmallCNN()
    manager = ScheduledModifierManager.from_yaml(IGNORE % (ignore, overrides))
    manager.modify(model, torch.optim.SGD(model.parameters(), lr=0.01), steps_per_epoch=SPE)
    return model


def test_ignore_leaves_named_layers_and_classes_float_and_the_next_layer_quantizes_its_input():
    model = _qat_with("[conv1]", "null")
    assert type(model.conv1) is nn.Conv2d and type(model.bn1) is nn.BatchNorm2d and type(model.relu1) is nn.ReLU
    assert isinstance(model.conv2, QATConv) and isinstance(model.conv3, QATConv)
    assert model.conv2.input_fake_quant is not None  # its input no longer comes from a quantized layer
    model = _qat_with("[Linear]", "null")
    assert type(model.fc) is nn.Linear and isinstance(model.conv1, QATConv)
    model = _qat_with("[Conv2d]", "{Linear: {input_activations: null, weights: null}}")
    assert not any(isinstance(m, (QATConv, QATLinear)) for m in model.modules())


def test_ignore_and_scheme_overrides_take_re_patterns_of_module_names():
    """llm-compressor's spelling (``ignore: ['re:.*lm_head']``): a pattern matches a module's whole name or a
    parent's; one that cannot compile is a located error at load."""
    from recal_core import RecipeError

    model = _qat_with("['re:conv[12]']", "null")
    assert type(model.conv1) is nn.Conv2d and type(model.conv2) is nn.Conv2d and isinstance(model.conv3, QATConv)
    model = _qat_with("null", "{'re:f.': {input_activations: null, weights: null}}")
    assert type(model.fc) is nn.Linear and isinstance(model.conv1, QATConv)
    with pytest.warns(UserWarning, match=r"ignore entry 're:conv' names no module"):  # a whole name, not a prefix
        _qat_with("['re:conv']", "null")
    with pytest.raises(RecipeError, match=r"<string>:5:\d+: .*ignore.*'re:\(conv': invalid regular expression"):
        _qat_with("['re:(conv']", "null")
    with pytest.raises(RecipeError, match=r"scheme_overrides.*'re:\(\?:a\{2000\}\)\{2000\}'.*unroll"):
        _qat_with("null", "{'re:(?:a{2000}){2000}': {weights: null}}")


def test_scheme_overrides_recal_cannot_honour_are_located_errors_and_unused_entries_warn():
    from recal_core import RecipeError

    with pytest.raises(RecipeError, match=r"<string>:6:\d+: .*'scheme_overrides'.*'Conv2d'.*symmetric per channel"):
        _qat_with("null", "{Conv2d: {weights: {symmetric: false}}}")
    with pytest.raises(RecipeError, match=r"some tensors float and others quantized"):
        _qat_with("null", "{fc: {weights: null}}")
    with pytest.warns(UserWarning, match=r"ignore entry 'LlamaRMSNorm' names no module"):
        _qat_with("[LlamaRMSNorm]", "null")
    model = nn.Sequential(nn.Embedding(10, 8), nn.Flatten(), nn.Linear(16, 4))
    with pytest.raises(RecipeError, match=r"'Embedding' \(0\).*embedding tables other than symmetric 8 or 4 bits per row"):
        _qat_with("null", "{Embedding: {input_activations: null, weights: {num_bits: 8, symmetric: false}}}", model)
    model = nn.Sequential(nn.Embedding(10, 8), nn.Flatten(), nn.Linear(16, 4))
    _qat_with("null", "{Embedding: {weights: null}}", model)  # the table stays float, the Linear quantizes
    assert type(model[0]) is nn.Embedding and isinstance(model[2], QATLinear)
    model = nn.Sequential(nn.LayerNorm(4), nn.Linear(4, 2))
    with pytest.warns(UserWarning, match=r"asks to quantize LayerNorm, which recal's QAT leaves float"):
        _qat_with("null", "{LayerNorm: {input_activations: {num_bits: 8}}}", model)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    _qat_with("null", "{ReLU: {input_activations: null, output_activations: null}}", model)  # consistent: silent
    assert isinstance(model[0], QATLinear)


class SharedReLU(nn.Module):
    """torchvision's BasicBlock: one ``self.relu`` for both activations, the second after the residual add."""

    def __init__(self):
        super().__init__()
        self.conv1, self.conv2 = nn.Conv2d(1, 4, 3, padding=1), nn.Conv2d(4, 4, 3, padding=1)
        self.relu = nn.ReLU()
        self.fc = nn.Linear(4 * 8 * 8, 10)

    def forward(self, x):
        y = self.relu(self.conv1(x))
        return self.fc(torch.flatten(self.relu(self.conv2(y) + y), 1))


class InvertedResidual(nn.Module):
    """MobileNetV2: a residual add with no activation after it, whose sum two blocks read (fan-out)."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU6())
        self.blocks = nn.ModuleList(nn.Sequential(nn.Conv2d(4, 8, 1), nn.BatchNorm2d(8), nn.ReLU6(),
                                                  nn.Conv2d(8, 4, 1), nn.BatchNorm2d(4)) for _ in range(2))
        self.fc = nn.Linear(4, 10)

    def forward(self, x):
        x = self.stem(x)
        for block in self.blocks:
            x = x + block(x)
        return self.fc(torch.flatten(torch.nn.functional.adaptive_avg_pool2d(x, 1), 1))


class Untraceable(InvertedResidual):
    """The same net with a shape check torch.fx cannot trace (as every Hugging Face model has)."""

    def forward(self, x):
        if x.dim() != 4:
            raise ValueError("a batch of images expected")
        return super().forward(x)


def _int8(model, tmp_path, dynamo=False):
    from recal_onnx import quantize_qat_export

    train_steps(model, torch.optim.SGD(model.parameters(), lr=0.01), batches(4))
    for fq in model.modules():
        if isinstance(fq, ActivationFakeQuantize):
            fq.observer_enabled = False
    path = export_onnx(model.eval(), torch.randn(1, 1, 8, 8), tmp_path / "qat.onnx", dynamo=dynamo)
    return quantize_qat_export(str(path), tmp_path / "int8.onnx")


def test_a_shared_relu_gets_an_observer_per_call_site(tmp_path):
    torch.manual_seed(0)
    model = SharedReLU()
    fake_quantize_model(model)
    assert model.conv1.relu and isinstance(model.relu, nn.ReLU)  # fused into conv1; the module stays (idempotent)
    result = _int8(model, tmp_path)
    assert list(model.recal_sites) == ["relu:forward:1"]  # the second call, after the add, has its own observer
    kinds = [n.op_type for n in result.model.graph.node]
    assert kinds.count("QLinearAdd") == 1 and kinds.count("QLinearConv") == 2 and not result.float_nodes, kinds
    assert "Relu" not in kinds and result.verification.max_steps <= 3


def test_a_shared_conv_is_named_in_a_warning():
    from recal_torch.qat import QATPlanWarning

    class SharedConv(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(4, 4, 3, padding=1)

        def forward(self, x):
            return self.conv(self.conv(x))

    with pytest.warns(QATPlanWarning, match=r"'conv' \(2 calls\).*give each call its own module"):
        fake_quantize_model(SharedConv())


@pytest.mark.parametrize("kind", [InvertedResidual, Untraceable], ids=["traced", "untraceable"])
def test_a_residual_add_without_activation_is_quantized_once(kind, tmp_path, caplog):
    torch.manual_seed(0)
    model = kind()
    with caplog.at_level("INFO", logger="recal_torch.qat.plan"):
        fake_quantize_model(model)
        result = _int8(model, tmp_path)
    assert sorted(model.recal_sites) == [":add:0", ":add:1"]  # both sums, each read by a conv and the next add
    assert all(isinstance(b[3], QATConv) and b[3].folded_bn is not None for b in model.blocks)
    assert model.stem[0].relu6 and isinstance(model.stem[2], nn.Identity)
    assert all(b[0].input_fake_quant is None or not b[0].input_fake_quant.active for b in model.blocks)
    kinds = [n.op_type for n in result.model.graph.node]
    assert kinds.count("QLinearAdd") == 2 and kinds.count("QLinearConv") == 5 and not result.float_nodes, kinds
    if kind is Untraceable:  # a linear whose output no quantized layer reads returns float there
        assert "plan from the first forward" in caplog.text and result.verification.max_steps is None
        assert result.verification.max_abs_diff <= 0.02 * result.verification.output_range
    else:
        assert result.verification.max_steps <= 3


def test_an_add_in_a_module_that_calls_a_stranger_stays_float_and_is_named():
    """A module that calls another module's child: its own calls cannot be told from that child's, so the sum
    gets no observer (a wrong call would be quantized otherwise), and the warning names the module."""

    class Borrower(nn.Module):
        def __init__(self, lender):
            super().__init__()
            object.__setattr__(self, "lender", lender)  # not a child: the lender's module
            self.conv = nn.Conv2d(4, 4, 1)

        def forward(self, x):
            return self.conv(x) + self.lender.blocks[0](x)

    class Net(InvertedResidual):
        def __init__(self):
            super().__init__()
            self.borrower = Borrower(self)

        def forward(self, x):
            return self.fc(torch.flatten(torch.nn.functional.adaptive_avg_pool2d(self.borrower(self.stem(x)), 1), 1))

    torch.manual_seed(0)
    model = Net()
    from recal_torch.qat import QATPlanWarning

    fake_quantize_model(model)
    with pytest.warns(QATPlanWarning, match=r"residual add in 'borrower' stays float.*\(blocks\.0\)"):
        model(torch.randn(2, 1, 8, 8))
    assert "recal_sites" not in model._modules


def test_call_site_observers_travel_in_checkpoints(tmp_path):
    torch.manual_seed(0)
    model = Untraceable()
    fake_quantize_model(model)
    train_steps(model, torch.optim.SGD(model.parameters(), lr=0.01), batches(2))
    state = model.state_dict()
    assert any(k.startswith("recal_sites.") for k in state)
    torch.manual_seed(1)
    fresh = Untraceable()
    fake_quantize_model(fresh)
    fresh.load_state_dict(state)  # before its first forward: the observers are created from the checkpoint
    fresh.eval(), model.eval()
    x = torch.randn(4, 1, 8, 8)
    torch.testing.assert_close(fresh(x), model(x))


class FunctionalActivations(nn.Module):
    """GoogLeNet / MobileNet style: a functional ReLU, a ReLU6 module, a functional Hardtanh(0, 6)."""

    def __init__(self):
        super().__init__()
        self.c1, self.b1 = nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4)
        self.c2, self.act2 = nn.Conv2d(4, 4, 3, padding=1), nn.ReLU6()
        self.c3 = nn.Conv2d(4, 4, 1)
        self.fc = nn.Linear(4 * 8 * 8, 10)

    def forward(self, x):
        x = torch.nn.functional.relu(self.b1(self.c1(x)))
        x = self.act2(self.c2(x))
        x = torch.nn.functional.hardtanh(self.c3(x), 0.0, 6.0)
        return self.fc(torch.flatten(x, 1))


def test_functional_relu_and_relu6_fold_into_the_range_before_them(tmp_path):
    from recal_onnx import quantize_qat_export

    torch.manual_seed(0)
    model = FunctionalActivations()
    fake_quantize_model(model)
    assert model.c1.relu and not model.c1.relu6 and model.c2.relu6 and model.c3.relu6
    assert isinstance(model.act2, nn.Identity)  # the module is fused; a function stays (idempotent after the clamp)
    assert model.c1.input_fake_quant is not None
    assert model.c2.input_fake_quant is None and model.c3.input_fake_quant is None and model.fc.input_fake_quant is None
    train_steps(model, torch.optim.SGD(model.parameters(), lr=0.01), batches(4))
    model.eval()
    for fq in model.modules():
        if isinstance(fq, ActivationFakeQuantize):
            fq.observer_enabled = False
    assert float(model.c2.activation_post_process.max_val) <= 6.0 and int(model.c2.activation_post_process.zero_point) == 0
    path = export_onnx(model, torch.randn(1, 1, 8, 8), tmp_path / "qat.onnx", dynamo=False)
    result = quantize_qat_export(str(path), tmp_path / "int8.onnx")
    kinds = [n.op_type for n in result.model.graph.node]
    assert kinds.count("QLinearConv") == 3 and kinds.count("QGemm") == 1 and not result.float_nodes
    assert "Relu" not in kinds and "Clip" not in kinds and result.verification.max_steps <= 3


class ConcatBlock(nn.Module):
    """An Inception-style block: two branches with functional ReLUs, concatenated, then a conv."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Conv2d(1, 4, 1), nn.Conv2d(1, 4, 3, padding=1)
        self.mix = nn.Conv2d(8, 4, 1)
        self.fc = nn.Linear(4 * 8 * 8, 10)

    def forward(self, x):
        y = torch.cat([torch.relu(self.a(x)), torch.nn.functional.relu(self.b(x))], dim=1)
        return self.fc(torch.flatten(torch.relu(self.mix(y)), 1))


def test_a_concat_of_quantized_branches_converts_to_integers(tmp_path):
    from recal_onnx import quantize_qat_export

    torch.manual_seed(0)
    model = ConcatBlock()
    fake_quantize_model(model)
    train_steps(model, torch.optim.SGD(model.parameters(), lr=0.01), batches(4))
    for fq in model.modules():
        if isinstance(fq, ActivationFakeQuantize):
            fq.observer_enabled = False
    path = export_onnx(model.eval(), torch.randn(1, 1, 8, 8), tmp_path / "qat.onnx", dynamo=False)
    result = quantize_qat_export(str(path), tmp_path / "int8.onnx")
    kinds = [n.op_type for n in result.model.graph.node]
    assert "QLinearConcat" in kinds and kinds.count("QLinearConv") == 3 and not result.float_nodes, kinds
    assert result.verification.max_steps <= 3


class SqueezeExcite(nn.Module):
    """EfficientNet / MobileNetV3 style: SiLU as a module (in place) and as a function, squeeze-excitation
    (pool, conv, SiLU, conv, sigmoid, ``x * gate``), and a multi-label head whose sigmoid the model returns."""

    def __init__(self):
        super().__init__()
        self.stem, self.bn, self.act = nn.Conv2d(1, 8, 3, padding=1), nn.BatchNorm2d(8), nn.SiLU(inplace=True)
        self.dw = nn.Conv2d(8, 8, 3, padding=1, groups=8)
        self.reduce, self.expand = nn.Conv2d(8, 2, 1), nn.Conv2d(2, 8, 1)
        self.project = nn.Conv2d(8, 4, 1)
        self.fc = nn.Linear(4 * 8 * 8, 10)

    def forward(self, x):
        x = self.act(self.bn(self.stem(x)))
        x = torch.nn.functional.silu(self.dw(x))
        gate = torch.sigmoid(self.expand(self.act(self.reduce(torch.nn.functional.adaptive_avg_pool2d(x, 1)))))
        x = self.project(x * gate)
        return torch.sigmoid(self.fc(torch.flatten(x, 1)))


@pytest.mark.parametrize("dynamo", [False, True], ids=["torchscript", "dynamo"])
def test_silu_and_squeeze_excitation_run_on_the_integers(dynamo, tmp_path):
    """Each SiLU call site quantizes its sigmoid and its product, the gate's sigmoid and ``x * gate`` are quantized
    (an observer per call site; the shared ``act`` module gets one per call): the int8 model is QLinearSigmoid /
    QLinearMul throughout, nothing float but the returned probabilities' sigmoid, and matches the QAT export."""
    torch.manual_seed(0)
    model = SqueezeExcite()
    fake_quantize_model(model)
    result = _int8(model, tmp_path, dynamo)
    assert sorted(model.recal_sites) == [":mul:0", ":sigmoid:0", ":silu:0", "act:forward:0", "act:forward:1"]
    assert not model.act.inplace  # its sites recompute the call from the input
    kinds = [n.op_type for n in result.model.graph.node]
    assert kinds.count("QLinearSigmoid") == 4 and kinds.count("QLinearMul") == 4 and not result.float_nodes, kinds
    assert kinds.count("QLinearConv") == 5 and kinds.count("QLinearGlobalAveragePool") == 1, kinds
    assert kinds.count("Sigmoid") == 1  # the head's: its probabilities stay float
    v = result.verification
    assert v.local_steps <= 1 and v.max_abs_diff <= 1e-5, v
    x = torch.randn(16, 1, 8, 8)
    session = ort.InferenceSession(str(tmp_path / "int8.onnx"), providers=["CPUExecutionProvider"])
    got = session.run(None, {"input": x.numpy()})[0]
    with torch.no_grad():
        expected = model.eval()(x).numpy()
    # the PyTorch QAT model computes the same SiLUs (measured 3.7e-4: float rounding across a step)
    assert np.abs(got - expected).max() <= 2e-3


class LibrarySiLU(nn.Module):
    """A library's own SiLU module (Hugging Face's ``SiLUActivation``, timm's ``Swish``): F.silu in a class of its
    own, not nn.SiLU."""

    def forward(self, x):
        return torch.nn.functional.silu(x)


def test_a_librarys_own_silu_module_is_a_silu_site(tmp_path):
    """MobileViT, EfficientNet and others run SiLU through ``transformers.activations.SiLUActivation``: recognised
    by what it computes (F.silu exactly, no parameters), its call site quantizes the sigmoid too and the int8
    model runs QLinearSigmoid and QLinearMul where it sat (MobileViT-small went from 0.81x to 1.20x
    ``quantize_static`` on the VNNI/AMX Xeon); a parameterless module computing something else is not one."""
    from recal_torch.qat.patterns import is_silu_module

    torch.manual_seed(0)
    model = SqueezeExcite()
    model.act = LibrarySiLU()
    fake_quantize_model(model)
    result = _int8(model, tmp_path, False)
    assert "act:forward:0" in model.recal_sites and "act:forward:1" in model.recal_sites
    kinds = [n.op_type for n in result.model.graph.node]
    assert kinds.count("QLinearSigmoid") == 4 and kinds.count("QLinearMul") == 4 and not result.float_nodes, kinds
    assert not is_silu_module(nn.Hardswish()) and not is_silu_module(type("Gelu", (nn.Module,), {
        "forward": lambda self, x: torch.nn.functional.gelu(x)})())


def test_silu_sites_travel_in_checkpoints():
    torch.manual_seed(0)
    model = SqueezeExcite()
    fake_quantize_model(model)
    train_steps(model, torch.optim.SGD(model.parameters(), lr=0.01), batches(2))
    state = model.state_dict()
    assert "recal_sites.act:forward:0.sigmoid.scale" in state and "recal_sites.:silu:0.product.scale" in state
    torch.manual_seed(1)
    fresh = SqueezeExcite()
    fake_quantize_model(fresh)
    fresh.load_state_dict(state)
    fresh.eval(), model.eval()
    x = torch.randn(4, 1, 8, 8)
    torch.testing.assert_close(fresh(x), model(x))


class PaddedNet(nn.Module):
    """A conv-BN-ReLU, a zero pad (functional), a conv with its own bias, a max pool and a linear."""

    def __init__(self):
        super().__init__()
        self.c1, self.bn1 = nn.Conv2d(1, 8, 3, bias=False), nn.BatchNorm2d(8)
        self.c2 = nn.Conv2d(8, 8, 3)
        self.fc = nn.Linear(8 * 3 * 3, 10)

    def forward(self, x):
        y = torch.relu(self.bn1(self.c1(x)))
        y = torch.relu(self.c2(torch.nn.functional.pad(y, (1, 1, 1, 1))))
        return self.fc(torch.flatten(torch.nn.functional.max_pool2d(y, 2), 1))


@pytest.mark.parametrize("dynamo", [True, False])
def test_export_writes_each_bias_on_the_int32_grid_of_its_layer(dynamo, tmp_path):
    """The int8 model holds a bias as ``round(bias / (s_x * s_w))`` in int32: the QAT export writes that value,
    so converting it adds no rounding (an off-grid bias flips output values near a rounding boundary, and on a
    deep net those flips travel). The input scale is found through the functional pad and the pool."""
    from recal_onnx import quantize_qat_export

    torch.manual_seed(0)
    model = PaddedNet()
    fake_quantize_model(model)
    train_steps(model, torch.optim.SGD(model.parameters(), lr=0.01), batches(4))
    model.eval()
    path = export_onnx(model, torch.randn(2, 1, 8, 8), tmp_path / "qat.onnx", dynamo=dynamo)
    found = assert_biases_on_grid(onnx.load(str(path)), 3)
    trained = [layer.folded_weight_and_bias()[1].detach().double().numpy() for layer in (model.c1, model.c2, model.fc)]
    moved = 0.0
    for (bias, step), float_bias in zip(found, trained):
        assert np.all(np.abs(bias - float_bias) <= 0.5 * step * (1 + 1e-3)), "moved by more than half a step"
        moved = max(moved, float(np.max(np.abs(bias - float_bias) / step)))
    assert moved > 0.01  # the trained biases sit between steps: the export did move them
    with torch.no_grad():  # the QAT model in PyTorch is still what the export computes, within a bias step
        x = torch.randn(64, 1, 8, 8, generator=torch.Generator().manual_seed(1))
        got = ort.InferenceSession(str(path)).run(None, {"input": x.numpy()})[0]
        assert (got.argmax(1) == model(x).numpy().argmax(1)).mean() >= 0.95
    result = quantize_qat_export(str(path), tmp_path / "int8.onnx", verify_inputs={"input": x.numpy()})
    v = result.verification
    assert v.argmax_agreement == 1.0 and v.max_abs_diff <= 1e-5 * v.output_range, v


def test_the_bias_grid_forgets_a_tensor_changed_in_place():
    """``out += identity`` changes a tensor that a quantize-dequantize had tagged: it is off that grid now."""
    from recal_torch.export.bias_grid import _GridTags

    tags = _GridTags()
    with tags:
        x = torch.fake_quantize_per_tensor_affine(torch.randn(4), 0.1, 0, 0, 255)
        y = torch.relu(x)
        assert tags.scale_of(x) == tags.scale_of(y) == pytest.approx(0.1)
        x += torch.full((4,), 0.033)
        assert tags.scale_of(x) is None and tags.scale_of(y) == pytest.approx(0.1)


def test_export_falls_back_to_the_other_exporter_and_says_why(tmp_path):
    """A forward the dynamo exporter cannot take (a branch on a tensor's value) is exported by TorchScript, with a
    warning naming the reason; a model neither exporter takes is one ExportError with both reasons, no file."""
    from recal_torch import ExportError, ExportWarning

    class Branchy(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 3)

        def forward(self, x):
            return self.fc(x) if float(x.sum()) > -1e9 else -self.fc(x)  # data-dependent: dynamo cannot trace it

    model = Branchy().eval()
    x = torch.randn(2, 4)
    with pytest.warns(ExportWarning, match=r"the dynamo exporter failed \(.*\); b.onnx was exported with the "
                                           r"TorchScript exporter \(dynamo=False\)"):
        path = export_onnx(model, x, tmp_path / "b.onnx")
    session = ort.InferenceSession(str(path))
    np.testing.assert_allclose(session.run(None, {"input": np.ones((5, 4), np.float32)})[0],
                               model(torch.ones(5, 4)).detach().numpy(), atol=1e-6)

    class Broken(nn.Module):
        def forward(self, x):
            raise RuntimeError("boom")

    with pytest.raises(ExportError, match=r"neither of torch's exporters exported Broken: the dynamo exporter "
                                          r"failed \(.*boom.*\); the TorchScript exporter failed \(.*boom"):
        export_onnx(Broken(), x, tmp_path / "broken.onnx")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b.onnx"]


def test_a_dynamic_batch_the_graph_cannot_run_is_caught_at_export(tmp_path):
    """A graph that fixes the sample's batch in a Reshape declares a dynamic batch it cannot run: the export runs
    the written model at one more row and, if it fails, uses the other exporter (or says both failed)."""
    from recal_torch import ExportError

    class Fixed(nn.Module):
        def forward(self, x):
            return x.reshape(2, 2, 2).sum((1, 2))  # written for a batch of 2 only

    with pytest.raises(ExportError, match=r"wrote a dynamic batch its graph cannot run \(at batch 3"):
        export_onnx(Fixed(), torch.randn(2, 4), tmp_path / "f.onnx", dynamo=False)
    assert not list(tmp_path.iterdir())
    path = export_onnx(Fixed(), torch.randn(2, 4), tmp_path / "g.onnx", dynamo=False, dynamic_batch=False)
    assert ort.InferenceSession(str(path)).run(None, {"input": np.ones((2, 4), np.float32)})[0].shape == (2,)


@pytest.mark.parametrize("dynamo", [False, True], ids=["torchscript", "dynamo"])
def test_an_nn_sequential_root_keeps_running_with_call_site_observers(dynamo, tmp_path):
    """torchvision and timm build whole models as nn.Sequential. The call sites' observers are one more child of
    the root; the Sequential calls it last, and it passes its input through: training, export and conversion
    work as for any root, and the SiLU / squeeze-excitation sites inside run on the integers."""
    from recal_onnx import quantize_qat_export

    torch.manual_seed(0)
    model = nn.Sequential(SqueezeExcite(), nn.Unflatten(1, (10, 1)), nn.Flatten())
    fake_quantize_model(model)
    train_steps(model, torch.optim.SGD(model.parameters(), lr=0.01), batches(4))
    assert sorted(model.recal_sites) and len(model) == 4  # SqueezeExcite's sites, held by the root
    model.eval()
    x = torch.randn(3, 1, 8, 8)
    assert model(x).shape == (3, 10)
    path = export_onnx(model, x[:1], tmp_path / "qat.onnx", dynamo=dynamo)
    result = quantize_qat_export(str(path), tmp_path / "int8.onnx")
    kinds = [n.op_type for n in result.model.graph.node]
    assert "QLinearMul" in kinds and "QLinearSigmoid" in kinds and result.verification.max_steps <= 3


class InlineModules(nn.Module):
    """What Hugging Face heads do: modules made and called inside forward (``nn.ReLU()(x)``), and a value branch
    that torch.fx cannot trace, so the plan comes from the first forward."""

    def __init__(self):
        super().__init__()
        self.c1, self.bn, self.c2 = nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4), nn.Conv2d(4, 4, 3, padding=1)
        self.fc = nn.Linear(4 * 8 * 8, 10)

    def forward(self, x):
        if float(x.mean()) > 1e9:
            x = -x
        y = nn.ReLU()(self.bn(self.c1(x)))
        y = y + self.c2(y)
        return self.fc(torch.flatten(nn.ReLU()(y), 1))


def test_modules_made_inside_forward_are_part_of_their_callers_plan(tmp_path, recwarn):
    from recal_onnx import quantize_qat_export

    torch.manual_seed(0)
    model = InlineModules()
    fake_quantize_model(model)
    train_steps(model, torch.optim.SGD(model.parameters(), lr=0.01), batches(4))
    # the add's only reader is the inline ReLU: its output holds the observer (the first ReLU folds into c1)
    assert sorted(model.recal_sites) == [":relu:1"] and model.c1.folded_bn is not None
    assert not [w for w in recwarn if "could not record" in str(w.message)]
    path = export_onnx(model.eval(), torch.randn(1, 1, 8, 8), tmp_path / "qat.onnx", dynamo=False)
    result = quantize_qat_export(str(path), tmp_path / "int8.onnx")
    kinds = [n.op_type for n in result.model.graph.node]
    assert "QLinearAdd" in kinds and kinds.count("QLinearConv") == 2 and not result.float_nodes, kinds


def test_a_forward_the_planner_cannot_record_is_a_warning_naming_the_layers():
    from recal_torch.qat import QATPlanWarning

    class Unrecordable(InlineModules):
        def forward(self, x):
            if torch.is_grad_enabled() is False and not getattr(self, "_seen", False):  # the planner's recording
                self._seen = True
                raise RuntimeError("a forward that fails while recorded")
            return super().forward(x)

    model = Unrecordable()
    fake_quantize_model(model)
    with pytest.warns(QATPlanWarning, match=r"could not record the first forward of Unrecordable \(RuntimeError: a "
                                            r"forward that fails while recorded\): residual adds.* stay float; "
                                            r"BatchNorm stays unfolded .* for c1, c2, fc"):
        model.train()(torch.randn(2, 1, 8, 8))


class MBConvLike(nn.Module):
    """EfficientNet's block as torchvision writes it: ``result = stochastic_depth(block(x)); result += input``."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())
        self.block = nn.Sequential(nn.Conv2d(8, 8, 3, padding=1, groups=8), nn.BatchNorm2d(8), nn.ReLU(),
                                   nn.Conv2d(8, 8, 1), nn.BatchNorm2d(8))
        self.stochastic_depth = StochasticDepth(0.2)
        self.fc = nn.Linear(8 * 8 * 8, 10)

    def forward(self, x):
        x = self.stem(x)
        result = self.stochastic_depth(self.block(x))
        result += x
        return self.fc(torch.flatten(result, 1))


@pytest.mark.parametrize("dynamo", [False, True], ids=["torchscript", "dynamo"])
def test_stochastic_depth_before_a_residual_add_keeps_the_add_integer(dynamo, tmp_path):
    from recal_onnx import quantize_qat_export

    torch.manual_seed(0)
    model = MBConvLike()
    fake_quantize_model(model)
    train_steps(model, torch.optim.SGD(model.parameters(), lr=0.01), batches(4))
    assert sorted(model.recal_sites) == [":add:0"] or sorted(model.recal_sites) == [":iadd:0"], model.recal_sites
    path = export_onnx(model.eval(), torch.randn(1, 1, 8, 8), tmp_path / "qat.onnx", dynamo=dynamo)
    result = quantize_qat_export(str(path), tmp_path / "int8.onnx")
    kinds = [n.op_type for n in result.model.graph.node]
    assert "QLinearAdd" in kinds and not result.float_nodes, (kinds, result.float_nodes)


def test_the_float_warning_names_the_module_of_each_anonymous_dynamo_node(tmp_path):
    """The dynamo exporter names nodes ``node_gelu``; the warning adds the module that ran each (its namespace
    metadata), one node per line."""
    from recal_onnx import UnconvertedOpsWarning, quantize_qat_export

    class Gelu(nn.Module):
        def __init__(self):
            super().__init__()
            self.c1, self.act, self.c2 = nn.Conv2d(1, 4, 3, padding=1), nn.GELU(), nn.Conv2d(4, 4, 3, padding=1)
            self.fc = nn.Linear(4 * 8 * 8, 10)

        def forward(self, x):
            return self.fc(torch.flatten(self.c2(self.act(self.c1(x))), 1))

    torch.manual_seed(0)
    model = Gelu()
    fake_quantize_model(model)
    train_steps(model, torch.optim.SGD(model.parameters(), lr=0.01), batches(2))
    path = export_onnx(model.eval(), torch.randn(1, 1, 8, 8), tmp_path / "qat.onnx")
    with pytest.warns(UnconvertedOpsWarning) as caught:
        quantize_qat_export(str(path), tmp_path / "int8.onnx")
    head, *lines = str(caught[0].message).splitlines()
    assert head.startswith("left in float") and "Erf x1" in head and len(lines) >= 2  # GELU, written out by dynamo
    # each with its reason after the module
    assert all(line.startswith("  ") and "' in module act (" in line and line.endswith(")") for line in lines), lines


class SharedConv(nn.Module):
    """One conv reached by two attribute paths and called twice: one observer cannot hold both calls' ranges."""

    def __init__(self):
        super().__init__()
        self.c1, self.c2 = nn.Conv2d(1, 4, 3, padding=1), nn.Conv2d(4, 4, 3, padding=1)
        self.again = self.c2
        self.fc = nn.Linear(4 * 8 * 8, 10)

    def forward(self, x):
        y = torch.relu(self.c2(torch.relu(self.c1(x))))
        return self.fc(torch.flatten(torch.relu(self.again(y)), 1))


def test_a_layer_called_twice_is_left_float_with_a_warning_naming_it():
    from recal_torch.qat import QATPlanWarning

    model = SharedConv()
    with pytest.warns(QATPlanWarning, match=r"'c2' \(2 calls\) called more than once in SharedConv's forward: left "
                                            r"float"):
        created = fake_quantize_model(model)
    assert type(model.c2) is nn.Conv2d and len(created) == 2  # c1 and fc
    from recal_torch import ScheduledModifierManager

    model = SharedConv()
    manager = ScheduledModifierManager.from_yaml("- !QuantizationModifier {start_epoch: 0}\n")
    with pytest.warns(QATPlanWarning):
        manager.modify(model, torch.optim.SGD(model.parameters(), lr=0.01), steps_per_epoch=2)
    assert manager.quantized_layers["c2"] == "float: called 2 times in one forward", manager.quantized_layers


class CompiledBlock(nn.Module):
    """A torch.compile'd submodule with a residual add around it."""

    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv2d(1, 4, 3, padding=1)
        self.block = torch.compile(nn.Sequential(nn.Conv2d(4, 4, 3, padding=1), nn.ReLU()))
        self.fc = nn.Linear(4 * 8 * 8, 10)

    def forward(self, x):
        y = torch.relu(self.c1(x))
        return self.fc(torch.flatten(y + self.block(y), 1))


@pytest.mark.slow
def test_a_torch_compiled_submodule_is_planned_and_runs_on_the_integers(tmp_path, recwarn):
    """The planner records the first forward with torch.compile's stance forced to eager: the compiled block's
    conv is planned, the add around it gets its observer, and the int8 model is integer throughout."""
    from recal_onnx import quantize_qat_export

    torch.manual_seed(0)
    model = CompiledBlock()
    fake_quantize_model(model)
    train_steps(model, torch.optim.SGD(model.parameters(), lr=0.01), batches(2))
    assert not [w for w in recwarn if "could not record" in str(w.message)]
    assert sorted(model.recal_sites) == [":add:0"]
    path = export_onnx(model.eval(), torch.randn(1, 1, 8, 8), tmp_path / "qat.onnx", dynamo=False)
    result = quantize_qat_export(str(path), tmp_path / "int8.onnx")
    kinds = [n.op_type for n in result.model.graph.node]
    assert "QLinearAdd" in kinds and not result.float_nodes, (kinds, result.float_nodes)


def test_the_users_forward_hooks_follow_their_layer_into_qat():
    """A feature-extraction hook on a conv keeps firing on its QAT module; a hook on a BatchNorm that folds away is
    named in a warning."""
    from recal_torch.qat import QATPlanWarning

    seen = []
    model = SmallCNN()
    model.conv3.register_forward_hook(lambda module, args, out: seen.append((type(module).__name__, out.shape)))
    fake_quantize_model(model)
    model(torch.randn(2, 1, 8, 8))
    assert seen and seen[-1][0].startswith("QATConv")

    class ConvBN(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv, self.bn = nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4)

        def forward(self, x):
            return self.bn(self.conv(x))

    model = ConvBN()
    model.bn.register_forward_hook(lambda *args: None)
    with pytest.warns(QATPlanWarning, match=r"'bn' \(BatchNorm2d\) has forward hooks, and QAT folds it"):
        fake_quantize_model(model)


def test_a_branch_the_first_forward_did_not_take_is_named():
    from recal_torch.qat import QATPlanWarning

    class Branchy(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Conv2d(1, 4, 3, padding=1), nn.Conv2d(1, 4, 3, padding=1)
            self.fc = nn.Linear(4 * 8 * 8, 10)

        def forward(self, x):
            y = self.a(x) if float(x.mean()) < 1e9 else self.b(x)  # data-dependent: fx cannot trace it
            return self.fc(torch.flatten(y, 1))

    model = Branchy()
    fake_quantize_model(model)
    with pytest.warns(QATPlanWarning, match=r"first forward of Branchy did not reach b \(a branch not taken\?\)"):
        model(torch.randn(2, 1, 8, 8))


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_pruning_and_qat_train_the_same_under_torch_compile(backend):
    """A recipe pruning from step 0 and starting QAT mid-run trains a ``torch.compile``'d model exactly as the
    plain one: QAT's first-forward plan records outside the compiled region (a graph break) and plans the same
    call sites (the squeeze-excitation's SiLUs, sigmoid and product), and the losses agree step by step (to float
    order, later on)."""
    from recal_torch.qat import QATPlanWarning

    recipe = ("- !GradualKSModifier {params: __ALL_PRUNABLE__, init_sparsity: 0.2, final_sparsity: 0.5, "
              "start_epoch: 0, end_epoch: 2, update_frequency: 1}\n- !QuantizationModifier {start_epoch: 1}\n")
    losses, sites = {}, {}
    for compiled in (False, True):
        torch.manual_seed(0)
        model = SqueezeExcite()
        manager = ScheduledModifierManager.from_yaml(recipe)
        optimizer = manager.modify(model, torch.optim.SGD(model.parameters(), lr=0.01), steps_per_epoch=3)
        run = torch.compile(model, backend=backend) if compiled else model
        losses[compiled] = []
        with warnings.catch_warnings():
            warnings.simplefilter("error", QATPlanWarning)  # a plan that could not record would warn
            for x, y in batches(7, batch=8):
                loss = torch.nn.functional.binary_cross_entropy(run(x), torch.nn.functional.one_hot(y, 10).float())
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                losses[compiled].append(float(loss.detach()))
        sites[compiled] = sorted(model.recal_sites)
    assert sites[True] == sites[False] and len(sites[True]) == 5, sites
    # the same through QAT's first steps; later a compiled graph's other float order moves a value on a rounding
    # boundary to the next step now and then (measured: 2.5e-4 of the loss by step 6)
    np.testing.assert_allclose(losses[True][:5], losses[False][:5], rtol=1e-5)
    np.testing.assert_allclose(losses[True], losses[False], rtol=1e-3)


def test_fake_quantizers_under_bf16_autocast_round_on_the_float32_grid():
    """An activation quantizer given a bf16 tensor (what autocast makes a conv return) returns bf16 holding exactly
    the float32 grid's values rounded to bf16: the same integers as in float32, whatever the dtype."""
    from recal_torch.qat import ActivationFakeQuantize

    torch.manual_seed(0)
    fq = ActivationFakeQuantize()
    fq.observe(torch.tensor([-1.0, 9.0]))
    x = (torch.rand(100_000) * 10 - 1).to(torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = fq(x)
    expected = torch.fake_quantize_per_tensor_affine(x.float(), fq.scale, fq.zero_point, 0, 255).to(torch.bfloat16)
    assert got.dtype == torch.bfloat16 and torch.equal(got, expected)


def _small_cnn_under(recipe: str, optimizer, seed: int = 0):
    """A SmallCNN (seeded) modified by ``recipe`` with ``optimizer(parameters)``, 4 steps an epoch: (model, manager,
    the optimizer modify returns)."""
    torch.manual_seed(seed)
    model = SmallCNN()
    manager = ScheduledModifierManager.from_yaml(recipe)
    return model, manager, manager.modify(model, optimizer(model.parameters()), steps_per_epoch=4)


@pytest.mark.filterwarnings("ignore:step .* learned scale.*fc.input_fake_quant:UserWarning")
def test_learned_input_scales_start_from_the_ranges_of_their_calibration_steps():
    """``observer_kwargs: {calibration_steps: 3}``: an input's learned scale starts from the first three training
    batches' ranges averaged (set at each of their forwards, then only trained); a run stopped mid-calibration
    resumes bit for bit; calibration on weights, or of zero steps, is a located error."""
    import copy

    from recal_core import RecipeError
    from recal_torch.qat import activation_qparams

    recipe = ("- !QuantizationModifier {start_epoch: 0, scheme: {weights: {}, input_activations: {symmetric: false, "
              "observer: lsq, observer_kwargs: {calibration_steps: 3}}}}\n")
    data = batches(8)

    def fresh():
        model, _, optimizer = _small_cnn_under(recipe, lambda p: torch.optim.SGD(p, lr=0.05))
        return model, optimizer

    model, optimizer = fresh()
    scales, ckpt = [], {}
    model.conv1.register_forward_hook(lambda m, args, out: scales.append(m.input_fake_quant.scale.detach().clone()))
    def keep(k):
        if k == 2:  # mid-calibration
            ckpt.update(copy.deepcopy({"model": model.state_dict(), "optimizer": optimizer.state_dict()}))

    train_steps(model, optimizer, data, after_step=keep)
    fq = model.conv1.input_fake_quant
    lo = torch.stack([x.min() for x, _ in data[:3]]).mean()
    hi = torch.stack([x.max() for x, _ in data[:3]]).mean()
    torch.testing.assert_close(fq.min_val, lo)
    torch.testing.assert_close(fq.max_val, hi)
    scales = scales[-len(data):]  # one per step (the plan's first forward recorded before them)
    torch.testing.assert_close(scales[2], activation_qparams(lo, hi)[0])  # the start, at the third batch
    assert int(fq.calibrated) == 3 and not torch.equal(scales[3], scales[7])  # then trained
    resumed, resumed_opt = fresh()
    load_checkpoint(resumed, resumed_opt, ckpt)
    train_steps(resumed, resumed_opt, data, start=2)
    assert_same_state(model, resumed)
    with pytest.raises(RecipeError, match=r"calibration_steps goes with input_activations"):
        ScheduledModifierManager.from_yaml(recipe.replace("weights: {}", "weights: {observer: lsq, observer_kwargs: "
                                                          "{calibration_steps: 2}}"))
    with pytest.raises(RecipeError, match=r"calibration_steps must be a whole number of steps from 1"):
        ScheduledModifierManager.from_yaml(recipe.replace("calibration_steps: 3", "calibration_steps: 0"))


@pytest.mark.filterwarnings("ignore:step .* learned scale.*fc.input_fake_quant:UserWarning")
def test_learned_scales_for_w8a8_weights_and_inputs_train_freeze_resume_and_convert(tmp_path):
    """``observer: lsq`` on a W8A8 scheme's weights and input activations: per-channel weight scales (from minmax)
    and the input quantizers' scales (from the first batch's range) train in param groups of their own, one per
    LR factor; they stop at the observers' freeze; a resumed run ends on the same bits; the int8 model verifies
    exactly as for observed scales (``quantized_layers`` says which scales are learned)."""
    import copy

    recipe = ("- !QuantizationModifier {start_epoch: 1, disable_quantization_observer_epoch: 2.5, scheme: "
              "{input_activations: {symmetric: false, observer: lsq}, weights: {observer: lsq, observer_kwargs: "
              "{lr_factor: %g}}}}\n")
    data = batches(12)

    def fresh(seed, factor=0.01):
        return _small_cnn_under(recipe % factor, lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9), seed)

    model, manager, optimizer = fresh(0)
    seen, ckpt = {}, {}

    def after(k):
        seen[k] = {n: p.detach().clone() for n, p in model.named_parameters() if n.endswith("scale")}
        if k == 6:
            ckpt.update(copy.deepcopy({"model": model.state_dict(), "optimizer": optimizer.state_dict()}))

    train_steps(model, optimizer, data, after_step=after)
    weights, inputs = optimizer.param_groups[1:]
    assert len(weights["params"]) == 4 and weights["lr"] == pytest.approx(0.0005)  # conv1..3, fc
    assert len(inputs["params"]) == 2 and inputs["lr"] == pytest.approx(0.05)  # the model's input, and fc's
    assert "per channel (learned scales), input uint8 (learned scale)" in manager.quantized_layers["conv1"]
    assert all(not torch.equal(seen[5][n], seen[9][n]) for n in seen[9])  # every learned scale moved
    assert all(torch.equal(seen[10][n], seen[12][n]) for n in seen[12])  # frozen from step 10
    resumed, _, resumed_opt = fresh(1)
    load_checkpoint(resumed, resumed_opt, ckpt)
    train_steps(resumed, resumed_opt, data[6:])
    assert_same_state(model, resumed)
    manager.finalize(model)
    result = _int8(model, tmp_path, False)
    assert result.verification.local_steps <= 1 and result.verification.max_steps <= 1, result.verification
    # under SGD a scale steps by its gradient: an LR that takes weight scales through zero holds them at eps, said
    # at the first step it happens, naming them
    from recal_core.errors import RecipeWarning

    model, manager, optimizer = fresh(0, factor=10)
    with pytest.warns(RecipeWarning, match=r"step \d: \d learned scale\(s\) at float32's eps .*weight_fake_quant.scale"
                                           r".*under SGD a scale steps by its gradient: lower observer_kwargs lr_factor"):
        train_steps(model, optimizer, data)


def test_under_adam_learned_scales_step_in_log_space_and_never_reach_the_floor():
    """AdamW moves a parameter by about its LR a step whatever its size: on the raw scale, weight scales of ~1e-2 at
    LR 0.05 went through zero and were floored. In log space each step is AdamW's step on ``log s``: the scales stay
    positive, each moves by a share of itself, and a resumed run ends on the same bits."""
    import copy

    from recal_torch.qat import EPS

    recipe = ("- !QuantizationModifier {start_epoch: 0, scheme: {input_activations: {symmetric: false, observer: lsq},"
              " weights: {observer: lsq}}}\n")
    data = batches(12)

    def fresh():
        return _small_cnn_under(recipe, lambda p: torch.optim.AdamW(p, lr=0.05))

    model, manager, optimizer = fresh()
    seen, ckpt = {}, {}

    def after(k):
        seen[k] = {n: p.detach().clone() for n, p in model.named_parameters() if n.endswith("scale")}
        if k == 5:
            ckpt.update(copy.deepcopy({"model": model.state_dict(), "optimizer": optimizer.state_dict()}))

    train_steps(model, optimizer, data, after_step=after)
    for k in range(2, 13):  # AdamW's first step is lr * sign: exactly a factor exp(+-0.05) on every scale
        for n, now in seen[k].items():
            ratio = now / seen[k - 1][n]
            assert bool((ratio > 0.8).all() and (ratio < 1.25).all()), (k, n, ratio)  # a share of itself
    assert all(bool((p > 100 * EPS).all()) for p in seen[12].values())
    resumed, _, resumed_opt = fresh()
    load_checkpoint(resumed, resumed_opt, ckpt)
    train_steps(resumed, resumed_opt, data[5:])
    assert_same_state(model, resumed)
    manager.finalize(model)  # no scale at the floor: nothing said


class _MatmulLinear(nn.Linear):
    """transformers' FalconLinear: ``x @ W.T + b`` written out, a Linear by what it computes."""

    def forward(self, x):
        return x @ self.weight.T + self.bias


class _AdapterLinear(nn.Linear):
    """A Linear with its own low-rank adapter: replacing it by a QAT linear would drop the adapter."""

    def __init__(self, n):
        super().__init__(n, n)
        self.down, self.up = nn.Parameter(torch.randn(2, n)), nn.Parameter(torch.randn(n, 2))

    def forward(self, x):
        return super().forward(x) + x @ self.down.T @ self.up.T


def test_a_linear_subclass_computing_a_linear_is_quantized_and_any_other_stays_float_with_a_warning_that_says_why():
    model = nn.Sequential(_MatmulLinear(8, 8), nn.ReLU(), _AdapterLinear(8))
    manager = ScheduledModifierManager.from_yaml("- !QuantizationModifier {start_epoch: 0}\n")
    with pytest.warns(UserWarning, match=r"1 Linear layers stay float: 2 \(_AdapterLinear\): a subclass of nn.Linear "
                                         r"whose own forward computes something other than x @ W.T \+ b"):
        manager.modify(model, torch.optim.SGD(model.parameters(), lr=0.1), steps_per_epoch=2)
    model(torch.randn(3, 8))
    assert isinstance(model[0], QATLinear) and type(model[2]) is _AdapterLinear


@pytest.mark.parametrize("bad", [-1.0, 0.0, float("nan")])
def test_a_scale_that_is_not_positive_and_finite_is_refused_at_export_naming_it(tmp_path, bad):
    """A learned scale set (or loaded) to -1, 0 or NaN after training: export refuses it by name and writes nothing
    (-1 would flip every sign it quantizes; 0 divides by zero inside torch). One so before ``finalize`` is held at
    float32's eps with a warning that names it, as after every step."""
    recipe = ("- !QuantizationModifier {start_epoch: 0, scheme: {input_activations: {symmetric: false, observer: "
              "lsq}, weights: {observer: lsq}}}\n")

    def trained():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))
        manager = ScheduledModifierManager.from_yaml(recipe)
        optimizer = manager.modify(model, torch.optim.SGD(model.parameters(), lr=1e-4), steps_per_epoch=4)
        for _ in range(2):
            optimizer.zero_grad()
            model(torch.randn(4, 8)).sum().backward()
            optimizer.step()
        return model, manager

    model, manager = trained()
    manager.finalize()
    with torch.no_grad():
        model.get_parameter("0.input_fake_quant.scale").fill_(bad)
    with pytest.raises(ValueError, match=r"0\.input_fake_quant\.scale is (-1|0|nan) .*positive and finite"):
        export_onnx(model, torch.randn(1, 8), tmp_path / "m.onnx")
    assert list(tmp_path.iterdir()) == []
    if bad == bad:  # not NaN: before finalize, the floor holds it and says so
        model, manager = trained()
        with torch.no_grad():
            model.get_parameter("2.weight_fake_quant.scale").fill_(bad)
        with pytest.warns(UserWarning, match=r"2\.weight_fake_quant\.scale"):
            manager.finalize()
        assert float(model.get_parameter("2.weight_fake_quant.scale").min()) > 0
        export_onnx(model, torch.randn(1, 8), tmp_path / "m.onnx")


def test_qat_layers_are_instances_of_the_layers_they_replace(tmp_path):
    """After modify, a QAT layer is an nn.Linear / nn.Conv2d / nn.Embedding (a weight-only one too), as torch.ao's
    are: class-based code finds them (PEFT-style target matching, Hugging Face's weight init, a wrap policy by
    class), the state dict keeps its keys and loads into the float model, and a second plan leaves them alone.
    One made from transformers' Conv1D (weight [in, out]) is no nn.Linear."""
    import copy

    import transformers
    from transformers.pytorch_utils import Conv1D

    from recal_torch.qat import QATConv, QATEmbedding, QATLinear, WeightOnlyLinear
    from recal_torch.qat.plan import quantizable_layers

    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(10, 8), nn.Flatten(), nn.Linear(24, 16), nn.ReLU(), nn.Unflatten(1, (4, 2, 2)),
                          nn.Conv2d(4, 4, 1), nn.Flatten(), nn.Linear(16, 4))
    float_keys = set(model.state_dict())
    recipe = "- !QuantizationModifier {start_epoch: 0}\n"
    manager = ScheduledModifierManager.from_yaml(recipe)
    optimizer = manager.modify(model, torch.optim.SGD(model.parameters(), lr=0.01), steps_per_epoch=4)
    ids = torch.randint(0, 10, (2, 3))
    model(ids).sum().backward()
    optimizer.step()
    assert isinstance(model[2], QATLinear) and isinstance(model[2], nn.Linear)
    assert isinstance(model[5], QATConv) and isinstance(model[5], nn.Conv2d) and not isinstance(model[5], nn.Conv1d)
    assert isinstance(model[0], QATEmbedding) and isinstance(model[0], nn.Embedding)
    targets = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]  # PEFT's match by class
    assert targets == ["2", "7"]
    before = model(ids)
    assert quantizable_layers(model) == []  # recal's own layers are not planned again
    assert sum(isinstance(m, (QATLinear, QATConv, QATEmbedding)) for m in model.modules()) == 4
    assert float_keys <= set(model.state_dict())
    config = transformers.BertConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32)
    init = transformers.BertPreTrainedModel(config)
    model.apply(init._init_weights)  # Hugging Face's init by class: it reaches the QAT layers' own Parameters
    assert not torch.equal(model(ids), before)
    copied = copy.deepcopy(model)  # (export copies the model: each class made again without arguments)
    assert [type(m) for m in copied.modules()] == [type(m) for m in model.modules()]
    torch.save(model, tmp_path / "whole.pt")
    loaded = torch.load(tmp_path / "whole.pt", weights_only=False)
    torch.testing.assert_close(loaded(ids), model(ids))
    conv1d = QATLinear(Conv1D(6, 4), False, True)
    assert not isinstance(conv1d, nn.Linear)
    weight_only = WeightOnlyLinear(nn.Linear(8, 4), 4, None)
    assert isinstance(weight_only, nn.Linear)


def test_a_module_without_forward_is_told_which_submodule_to_name():
    """A LightningModule-style model whose training_step calls ``self.net(x)`` has no forward of its own: its QAT
    plan, made from the first forward, would never be made (layers unfused, BatchNorm not folded) and nothing said
    so. A QATPlanWarning names the module to give the QuantizationModifier's ``submodules``; with it the plan is
    made from that module's first forward and the BatchNorm is folded."""
    from recal_torch.qat import QATPlanWarning

    class Steps(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(16, 2))

        def training_step(self, x):
            return self.net(x).sum()

    def run(recipe):
        torch.manual_seed(0)
        model = Steps()
        manager = ScheduledModifierManager.from_yaml(recipe)
        optimizer = manager.modify(model, torch.optim.SGD(model.parameters(), lr=0.01), steps_per_epoch=2)
        model.training_step(torch.randn(2, 1, 4, 4)).backward()
        optimizer.step()
        return model

    with pytest.warns(QATPlanWarning, match=r"Steps has no forward\(\).*submodules \(submodules: \[net\]\)"):
        run("- !QuantizationModifier {start_epoch: 0}\n")
    with warnings.catch_warnings():
        warnings.simplefilter("error", QATPlanWarning)
        model = run("- !QuantizationModifier {start_epoch: 0, submodules: [net]}\n")
    assert isinstance(model.net[1], FoldedBatchNorm)
