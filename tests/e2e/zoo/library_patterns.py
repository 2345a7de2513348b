"""Blocks written the way torchvision and timm write them (neither installs beside the local torch build):
ShuffleNetV2's channel split and shuffle, DenseNet's dense block and transition (pre-activation BatchNorm on
concatenated features), timm's BatchNormAct2d in ConvNormAct (a RepVGG-style residual), EfficientNet's
stochastic depth before the residual add."""

import torch
import torch.nn.functional as F
from torch import nn


def channel_shuffle(x, groups):
    """torchvision's ShuffleNetV2 shuffle: view, transpose, view."""
    b, c, h, w = x.size()
    x = x.view(b, groups, c // groups, h, w)
    x = torch.transpose(x, 1, 2).contiguous()
    return x.view(b, -1, h, w)


class ShuffleUnit(nn.Module):
    """ShuffleNetV2's stride-1 unit: half the channels pass, half go through the branch; then shuffled."""

    def __init__(self, c):
        super().__init__()
        h = c // 2
        self.branch2 = nn.Sequential(nn.Conv2d(h, h, 1, bias=False), nn.BatchNorm2d(h), nn.ReLU(inplace=True),
                                     nn.Conv2d(h, h, 3, 1, 1, groups=h, bias=False), nn.BatchNorm2d(h),
                                     nn.Conv2d(h, h, 1, bias=False), nn.BatchNorm2d(h), nn.ReLU(inplace=True))

    def forward(self, x):
        x1, x2 = x.chunk(2, dim=1)
        return channel_shuffle(torch.cat((x1, self.branch2(x2)), dim=1), 2)


class DenseLayer(nn.Module):
    """DenseNet's layer: BN -> ReLU -> 1x1 conv -> BN -> ReLU -> 3x3 conv on the concatenated features."""

    def __init__(self, cin, growth):
        super().__init__()
        self.norm1, self.relu1, self.conv1 = nn.BatchNorm2d(cin), nn.ReLU(inplace=True), nn.Conv2d(cin, 16, 1, bias=False)
        self.norm2, self.relu2, self.conv2 = nn.BatchNorm2d(16), nn.ReLU(inplace=True), nn.Conv2d(16, growth, 3, padding=1, bias=False)

    def forward(self, inputs):
        x = torch.cat(inputs, 1)
        return self.conv2(self.relu2(self.norm2(self.conv1(self.relu1(self.norm1(x))))))


class DenseBlock(nn.ModuleDict):
    """DenseNet's block: every layer reads all earlier features, concatenated."""

    def __init__(self, cin, growth, n):
        super().__init__()
        for i in range(n):
            self.add_module(f"denselayer{i}", DenseLayer(cin + i * growth, growth))

    def forward(self, x):
        features = [x]
        for layer in self.values():
            features.append(layer(features))
        return torch.cat(features, 1)


class Transition(nn.Sequential):
    """DenseNet's transition: BN, ReLU, 1x1 conv, 2x2 average pool."""

    def __init__(self, cin, cout):
        super().__init__(nn.BatchNorm2d(cin), nn.ReLU(inplace=True), nn.Conv2d(cin, cout, 1, bias=False), nn.AvgPool2d(2, 2))


class BatchNormAct2d(nn.BatchNorm2d):
    """timm's: a BatchNorm that applies its own activation (``drop`` and ``act`` children)."""

    def __init__(self, c):
        super().__init__(c)
        self.drop, self.act = nn.Identity(), nn.ReLU(inplace=True)

    def forward(self, x):
        x = F.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias, self.training, self.momentum, self.eps)
        return self.act(self.drop(x))


class ConvNormAct(nn.Module):
    """timm's conv + BatchNormAct2d."""

    def __init__(self, cin, cout, stride=1):
        super().__init__()
        self.conv, self.bn = nn.Conv2d(cin, cout, 3, stride, 1, bias=False), BatchNormAct2d(cout)

    def forward(self, x):
        return self.bn(self.conv(x))


class RepVGGish(nn.Module):
    """Two ConvNormActs and a residual add."""

    def __init__(self, c):
        super().__init__()
        self.a, self.b = ConvNormAct(c, c), ConvNormAct(c, c)

    def forward(self, x):
        return self.b(self.a(x)) + x


class StochasticDepth(nn.Module):
    """torchvision.ops.StochasticDepth: random row drops in training, identity at eval."""

    def __init__(self, p: float):
        super().__init__()
        self.p = p

    def forward(self, x):
        if not self.training or self.p == 0.0:
            return x
        keep = torch.empty([x.shape[0]] + [1] * (x.ndim - 1), dtype=x.dtype).bernoulli_(1 - self.p)
        return x * keep.div_(1 - self.p)


class MBConv(nn.Module):
    """torchvision's EfficientNet block without squeeze-excitation: ``result = stochastic_depth(block(x));
    result += input``."""

    def __init__(self, c, expand=4):
        super().__init__()
        hidden = c * expand
        self.block = nn.Sequential(nn.Conv2d(c, hidden, 1, bias=False), nn.BatchNorm2d(hidden), nn.SiLU(inplace=True),
                                   nn.Conv2d(hidden, hidden, 3, 1, 1, groups=hidden, bias=False),
                                   nn.BatchNorm2d(hidden), nn.SiLU(inplace=True),
                                   nn.Conv2d(hidden, c, 1, bias=False), nn.BatchNorm2d(c))
        self.stochastic_depth = StochasticDepth(0.2)

    def forward(self, x):
        result = self.stochastic_depth(self.block(x))
        result += x
        return result
