"""The models and helpers the PyTorch QAT tests share."""

import numpy as np
import torch
from torch import nn

from recal_torch import ScheduledModifierManager, export_onnx
from recal_torch.qat import ActivationFakeQuantize
from tests.e2e.zoo.library_patterns import StochasticDepth
from tests.support.torch_models import SmallCNN, batches, train_steps

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


def _run_prune_qat(stop=None, seed=0, opt="sgd"):
    torch.manual_seed(seed)
    model = SmallCNN()
    manager = ScheduledModifierManager.from_yaml(PRUNE_QAT)
    inner = (torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9) if opt == "sgd"
             else torch.optim.Adam(model.parameters(), lr=0.005))
    optimizer = manager.modify(model, inner, steps_per_epoch=SPE)
    return model, manager, optimizer


def _checkpoint(model, optimizer):
    import copy

    return copy.deepcopy({"model": model.state_dict(), "optimizer": optimizer.state_dict()})


def _trained_qat_model():
    model, manager, optimizer = _run_prune_qat()
    train_steps(model, optimizer, batches(24), stop=manager.max_epochs * SPE)
    manager.finalize(model)
    return model.eval()


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


class LibrarySiLU(nn.Module):
    """A library's own SiLU module (Hugging Face's ``SiLUActivation``, timm's ``Swish``): F.silu in a class of its
    own, not nn.SiLU."""

    def forward(self, x):
        return torch.nn.functional.silu(x)


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


def _small_cnn_under(recipe: str, optimizer, seed: int = 0):
    """A SmallCNN (seeded) modified by ``recipe`` with ``optimizer(parameters)``, 4 steps an epoch: (model, manager,
    the optimizer modify returns)."""
    torch.manual_seed(seed)
    model = SmallCNN()
    manager = ScheduledModifierManager.from_yaml(recipe)
    return model, manager, manager.modify(model, optimizer(model.parameters()), steps_per_epoch=4)


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
