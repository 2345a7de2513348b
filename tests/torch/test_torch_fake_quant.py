"""recal_torch.qat.fake_quant: torch's fake-quantization values and gradients, without reading the device back."""

import math

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from recal_torch import ScheduledModifierManager
from recal_torch.qat.fake_quant import fake_quantize, per_channel

# ops that wait for the device: torch's fake quantizers read their zero points back (.item()) inside the kernel call
HOST_READS = {"aten.fake_quantize_per_channel_affine_cachemask.default",
              "aten._fake_quantize_learnable_per_channel_affine.default",
              "aten._fake_quantize_learnable_per_tensor_affine.default", "aten._local_scalar_dense.default",
              "aten.nonzero.default", "aten.item.default"}


class Dispatched(TorchDispatchMode):
    """The aten ops run under it, by name."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def _pair(x):
    return x.clone().requires_grad_(), x.clone().requires_grad_()


@pytest.mark.parametrize("levels", [127, 64, 7])
def test_per_channel_values_and_gradients_are_torchs(levels):
    """Weights past a shrunk scale saturate: the same values bit for bit, the same straight-through mask."""
    torch.manual_seed(0)
    w = torch.randn(16, 3, 3, 3)
    scale = w.abs().amax(dim=(1, 2, 3)) / levels * 0.7
    theirs, ours = _pair(w)
    expected = torch.fake_quantize_per_channel_affine(theirs, scale, torch.zeros(16, dtype=torch.int32), 0,
                                                      -levels, levels)
    got = fake_quantize(ours, per_channel(scale, ours), 0.0, -levels, levels)
    assert torch.equal(got, expected)
    g = torch.randn_like(w)
    (expected * g).sum().backward()
    (got * g).sum().backward()
    assert torch.equal(ours.grad, theirs.grad) and (ours.grad == 0).any()


def test_learned_scales_get_lsqs_gradient():
    """Per channel (symmetric weights) and per tensor (asymmetric activations with a zero point): the values of
    torch's learnable ops, the same input gradient and their scale gradient (to float order)."""
    torch.manual_seed(0)
    w = torch.randn(8, 32)
    s = (w.abs().amax(1) / 7 * 0.8)
    (w1, w2), (s1, s2) = _pair(w), _pair(s)
    factor = 1 / math.sqrt(32 * 7)
    theirs = torch._fake_quantize_learnable_per_channel_affine(w1, s1, torch.zeros(8), 0, -7, 7, factor)
    ours = fake_quantize(w2, per_channel(s2, w2), 0.0, -7, 7, factor)
    x = torch.randn(4, 6, 5) * 2 + 0.5
    (x1, x2), (a1, a2) = _pair(x), _pair(torch.tensor([0.02]))
    zero = torch.tensor([100.0])
    theirs_x = torch._fake_quantize_learnable_per_tensor_affine(x1, a1, zero, 0, 255, 0.01)
    ours_x = fake_quantize(x2, a2, zero, 0, 255, 0.01)
    assert torch.equal(ours, theirs) and torch.equal(ours_x, theirs_x)
    for out in (theirs, ours):
        (out * torch.linspace(-1, 1, out.numel()).reshape(out.shape)).sum().backward()
    for out in (theirs_x, ours_x):
        (out * torch.linspace(-1, 1, out.numel()).reshape(out.shape)).sum().backward()
    assert torch.equal(w1.grad, w2.grad) and torch.equal(x1.grad, x2.grad)
    torch.testing.assert_close(s2.grad, s1.grad, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(a2.grad, a1.grad, rtol=1e-5, atol=1e-7)


def test_bf16_in_bf16_out_on_the_float32_grid():
    x = (torch.rand(1000) * 10 - 1).to(torch.bfloat16)
    scale = torch.tensor(0.04)
    got = fake_quantize(x, scale, torch.tensor(25, dtype=torch.int32), 0, 255)
    expected = torch.fake_quantize_per_tensor_affine(x.float(), scale, torch.tensor(25, dtype=torch.int32), 0, 255)
    assert got.dtype == torch.bfloat16 and torch.equal(got, expected.to(torch.bfloat16))
    with pytest.raises(ValueError, match="must be 0"):
        fake_quantize(x, scale, 3.0, 0, 255)


def test_a_qat_step_reads_nothing_back_from_the_device():
    """W8A8 convs (observed and learned scales) and an int4 weight-only linear in groups: a training step after the
    plan dispatches no op that waits for the device (on a GPU each would stall the step's kernel queue)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1),
                          nn.ReLU(), nn.Flatten(), nn.Linear(8 * 6 * 6, 64), nn.ReLU(), nn.Linear(64, 10))
    recipe = """
- !QuantizationModifier {start_epoch: 0, scheme: {input_activations: {symmetric: false, observer: lsq}, weights: {}},
                         scheme_overrides: {'6': {input_activations: null, weights: {num_bits: 4, strategy: group,
                                                                                      group_size: 32}},
                                            '3': {weights: {observer: lsq}}}}
"""
    manager = ScheduledModifierManager.from_yaml(recipe)
    optimizer = manager.modify(model, torch.optim.SGD(model.parameters(), lr=0.01), steps_per_epoch=4)
    x, y = torch.randn(4, 3, 6, 6), torch.randint(0, 10, (4,))

    def step():
        loss = nn.functional.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

    step()  # the plan records the first forward
    with Dispatched() as seen:
        step()
    assert "aten.convolution.default" in seen.ops
    assert not HOST_READS & set(seen.ops), sorted(HOST_READS & set(seen.ops))

