"""Small torch models and a deterministic training loop shared by the PyTorch tests."""

import torch
from torch import nn


class SmallCNN(nn.Module):
    """Conv-BN-ReLU, a residual block, pooling and a linear head (8x8 single-channel input)."""

    def __init__(self, classes: int = 10, width: int = 8):
        super().__init__()
        self.conv1 = nn.Conv2d(1, width, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu1 = nn.ReLU()
        self.conv2 = nn.Conv2d(width, width, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(width)
        self.relu2 = nn.ReLU()
        self.pool = nn.MaxPool2d(2)
        self.conv3 = nn.Conv2d(width, width, 3, padding=1)
        self.relu3 = nn.ReLU()
        self.gap = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(width, classes)

    def forward(self, x):
        y = self.relu1(self.bn1(self.conv1(x)))
        y = self.relu2(self.bn2(self.conv2(y)) + y)
        y = self.relu3(self.conv3(self.pool(y)))
        return self.fc(torch.flatten(self.gap(y), 1))


def batches(n_batches: int, batch: int = 16, seed: int = 0, classes: int = 10):
    g = torch.Generator().manual_seed(seed)
    xs = torch.randn(n_batches, batch, 1, 8, 8, generator=g)
    ys = torch.randint(0, classes, (n_batches, batch), generator=g)
    return list(zip(xs, ys))


def train_steps(model, optimizer, data, start: int = 0, stop: int | None = None, after_step=None):
    """Run steps [start, stop) over ``data`` (cycled); call ``after_step(k)`` after each optimizer step."""
    stop = len(data) if stop is None else stop
    model.train()
    for k in range(start, stop):
        x, y = data[k % len(data)]
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
        if after_step is not None:
            after_step(k + 1)


def qat_small_cnn(steps: int = 3):
    """A SmallCNN after a few QAT steps under recal (observers hold ranges), finalized, in eval mode."""
    from recal_torch import ScheduledModifierManager

    torch.manual_seed(0)
    model = SmallCNN()
    manager = ScheduledModifierManager.from_yaml("- !QuantizationModifier {start_epoch: 0}\n"
                                                 "- !EpochRangeModifier {start_epoch: 0, end_epoch: 1}")
    optimizer = manager.modify(model, torch.optim.SGD(model.parameters(), lr=0.01), steps_per_epoch=steps)
    train_steps(model, optimizer, batches(steps))
    manager.finalize(model)
    return model.eval()


class CausalLMLogits(nn.Module):
    """A Hugging Face causal LM as ``ids -> logits`` with no KV cache: the graph an ONNX export of a decoder holds."""

    def __init__(self, lm: nn.Module):
        super().__init__()
        self.lm = lm

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lm(input_ids=ids, use_cache=False).logits


def load_checkpoint(model, optimizer, checkpoint: dict) -> None:
    """Resume as recal's docs say: the optimizer first (it re-creates the QAT layers), then the model."""
    optimizer.load_state_dict(checkpoint["optimizer"])
    model.load_state_dict(checkpoint["model"])


def assert_same_state(a, b) -> None:
    """Two models hold the same state dict, key for key and bit for bit."""
    for (na, pa), (nb, pb) in zip(a.state_dict().items(), b.state_dict().items()):
        assert na == nb and torch.equal(pa, pb), na


def train_planned(model, recipe: str, batches, loss, lr: float, steps: int, example_inputs=None):
    """``steps`` SGD steps of ``loss`` over ``batches`` (cycled) under a planned ``recipe`` (two steps an epoch),
    finalized and thinned, in eval mode: what the plan's recipe makes of ``model``."""
    from recal_core import load_recipe
    from recal_torch import ScheduledModifierManager, thin

    manager = ScheduledModifierManager(load_recipe(recipe))
    optimizer = manager.modify(model, torch.optim.SGD(model.parameters(), lr=lr), steps_per_epoch=2,
                               example_inputs=example_inputs)
    model.train()
    for k in range(steps):
        optimizer.zero_grad()
        loss(model, batches[k % len(batches)]).backward()
        optimizer.step()
    manager.finalize(model)
    thin(model.eval())
