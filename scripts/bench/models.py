"""Models for the benchmarks and the demo's speed part: torchvision-style CNNs and a BERT-sized MLP,
written here (PyPI's torchvision does not import beside the local torch build), random weights.

Also :func:`templates`, synthetic data that is learnable in a few steps (class templates plus noise),
so QAT observers hold real ranges and logits separate.
"""

from __future__ import annotations

import torch
from torch import nn


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.relu1 = nn.ReLU()
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.relu2 = nn.ReLU()
        self.down = None
        if stride != 1 or cin != cout:
            self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        y = self.bn2(self.conv2(self.relu1(self.bn1(self.conv1(x)))))
        return self.relu2(y + (x if self.down is None else self.down(x)))


class ResNet18(nn.Module):
    def __init__(self, classes: int = 1000):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU()
        self.pool = nn.MaxPool2d(3, 2, 1)
        layers, cin = [], 64
        for cout, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
            layers += [BasicBlock(cin, cout, stride), BasicBlock(cout, cout, 1)]
            cin = cout
        self.layers = nn.Sequential(*layers)
        self.gap = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(512, classes)

    def forward(self, x):
        x = self.pool(self.relu(self.bn1(self.conv1(x))))
        return self.fc(torch.flatten(self.gap(self.layers(x)), 1))


class Bottleneck(nn.Module):
    def __init__(self, cin: int, width: int, stride: int):
        super().__init__()
        cout = 4 * width
        self.conv1, self.bn1 = nn.Conv2d(cin, width, 1, bias=False), nn.BatchNorm2d(width)
        self.conv2, self.bn2 = nn.Conv2d(width, width, 3, stride, 1, bias=False), nn.BatchNorm2d(width)
        self.conv3, self.bn3 = nn.Conv2d(width, cout, 1, bias=False), nn.BatchNorm2d(cout)
        self.relu1, self.relu2, self.relu3 = nn.ReLU(), nn.ReLU(), nn.ReLU()
        self.down = None
        if stride != 1 or cin != cout:
            self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        y = self.relu2(self.bn2(self.conv2(self.relu1(self.bn1(self.conv1(x))))))
        return self.relu3(self.bn3(self.conv3(y)) + (x if self.down is None else self.down(x)))


class ResNet50(nn.Module):
    def __init__(self, classes: int = 1000):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU(),
                                  nn.MaxPool2d(3, 2, 1))
        layers, cin = [], 64
        for width, count, stride in ((64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)):
            for i in range(count):
                layers.append(Bottleneck(cin, width, stride if i == 0 else 1))
                cin = 4 * width
        self.layers = nn.Sequential(*layers)
        self.fc = nn.Linear(cin, classes)

    def forward(self, x):
        return self.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(self.layers(self.stem(x)), 1), 1))


class LinearStack(nn.Module):
    """BERT-base-sized feed-forward blocks: 768 -> 3072 -> 768, ``depth`` times, and a 2-way head."""

    def __init__(self, hidden: int = 768, depth: int = 4):
        super().__init__()
        blocks = []
        for _ in range(depth):
            blocks += [nn.Linear(hidden, 4 * hidden), nn.ReLU(), nn.Linear(4 * hidden, hidden), nn.ReLU()]
        self.blocks = nn.Sequential(*blocks)
        self.head = nn.Linear(hidden, 2)

    def forward(self, x):
        return self.head(self.blocks(x))


def templates(shape: tuple[int, ...], classes: int, seed: int = 0):
    """A sampler of (x, y): ``x = template[y] + noise``, learnable in a few steps."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(classes, *shape, generator=g)

    def sample(n: int):
        y = torch.randint(0, classes, (n,), generator=g)
        return base[y] + 0.5 * torch.randn(n, *shape, generator=g), y

    return sample


QAT_RECIPE = """
- !EpochRangeModifier {start_epoch: 0, end_epoch: 1}
- !QuantizationModifier {start_epoch: 0, freeze_bn_stats_epoch: 0.5, reduce_range: true}
"""
"""A few QAT steps on synthetic data (BatchNorm frozen half way), so the benchmarks' observers hold ranges; 7-bit
weights, recal's default path (exact and fast on every x86 CPU)."""


def train_steps(model: nn.Module, optimizer: torch.optim.Optimizer, sample, steps: int, batch: int) -> nn.Module:
    """``steps`` optimizer steps on batches of ``sample(batch)``, cross-entropy; returns the model in eval mode."""
    model.train()
    for _ in range(steps):
        x, y = sample(batch)
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
    return model.eval()


def torch_init(model: nn.Module) -> nn.Module:
    """``model`` with torch's own initialisation of its convs, norms and linears: transformers' draws (BatchNorm
    weights near 0) make some random nets' activations vanish into denormals, whose fp32 run then takes 25x longer
    and whose calibration sees nothing."""
    for module in model.modules():
        if isinstance(module, (nn.Conv2d, nn.BatchNorm2d, nn.Linear, nn.LayerNorm)):
            module.reset_parameters()
    return model
