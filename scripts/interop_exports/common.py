"""What every export script here shares: a small ResNet (torchvision's BasicBlock, widths 16 to 128, 32x32 inputs,
10 classes; random weights, a few hundred kB) and synthetic calibration batches. Imports torch alone, so it runs
in each tool's own virtual environment beside its pinned torch."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
from zoo import BasicBlock  # noqa: E402

FIXTURES = ROOT / "tests" / "fixtures" / "interop"
SIZE, CLASSES = 32, 10


class SmallResNet(nn.Module):
    """ResNet-18's stem and four stages of BasicBlocks at 1/4 width, one block a stage."""

    def __init__(self, classes: int = CLASSES):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, 1, 1, bias=False), nn.BatchNorm2d(16), nn.ReLU())
        layers, cin = [], 16
        for cout, stride in ((16, 1), (32, 2), (64, 2), (128, 2)):
            layers.append(BasicBlock(cin, cout, stride))
            cin = cout
        self.layers = nn.Sequential(*layers)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(cin, classes)

    def forward(self, x):
        return self.fc(torch.flatten(self.pool(self.layers(self.stem(x))), 1))


def calibration(batches: int = 8, batch: int = 8, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(batch, 3, SIZE, SIZE, generator=g) for _ in range(batches)]


def trained(model: nn.Module, steps: int = 20, seed: int = 0) -> nn.Module:
    """A few SGD steps on class templates plus noise, so the batch norms and ranges are a trained net's."""
    g = torch.Generator().manual_seed(seed)
    templates = torch.randn(CLASSES, 3, SIZE, SIZE, generator=g)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    model.train()
    for _ in range(steps):
        y = torch.randint(0, CLASSES, (32,), generator=g)
        x = templates[y] + 0.5 * torch.randn(32, 3, SIZE, SIZE, generator=g)
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
    return model.eval()


def export_torchscript(model: nn.Module, name: str, opset: int) -> None:
    """``model`` by torch.onnx's TorchScript path (the one these tools document), batch fixed at 1, into
    ``FIXTURES / name``."""
    import warnings

    FIXTURES.mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(model, torch.randn(1, 3, SIZE, SIZE), FIXTURES / name, dynamo=False, input_names=["input"],
                          opset_version=opset)
    print("wrote", FIXTURES / name)
