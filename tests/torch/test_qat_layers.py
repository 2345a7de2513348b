"""PyTorch QAT layers and quantizers: numbers against a numpy reference, fusion, the layers QAT puts in a float layer's
place."""

import warnings

import numpy as np
import onnx
import pytest
import torch
from torch import nn

from recal_torch import QATConv, QATLinear, ScheduledModifierManager, export_onnx, fake_quantize_model
from recal_torch.qat import ActivationFakeQuantize, FoldedBatchNorm, QuantizedReLU, WeightFakeQuantize
from tests.support.torch_models import SmallCNN, batches, train_steps
from tests.torch.qat_models import _AdapterLinear, _MatmulLinear, np_fake_quant


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


def test_a_linear_subclass_computing_a_linear_is_quantized_and_any_other_stays_float_with_a_warning_that_says_why():
    model = nn.Sequential(_MatmulLinear(8, 8), nn.ReLU(), _AdapterLinear(8))
    manager = ScheduledModifierManager.from_yaml("- !QuantizationModifier {start_epoch: 0}\n")
    with pytest.warns(UserWarning, match=r"1 Linear layers stay float: 2 \(_AdapterLinear\): a subclass of nn.Linear "
                                         r"whose own forward computes something other than x @ W.T \+ b"):
        manager.modify(model, torch.optim.SGD(model.parameters(), lr=0.1), steps_per_epoch=2)
    model(torch.randn(3, 8))
    assert isinstance(model[0], QATLinear) and type(model[2]) is _AdapterLinear


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
