"""Training-step overhead of recal's masking in PyTorch, against a plain step and torch.nn.utils.prune.

A small ResNet-style CNN, batch 32, 32x32 inputs, CPU. Prints a table of median step times.

    python scripts/bench_torch_overhead.py [--steps 60] [--threads 2]
"""

from __future__ import annotations

import argparse

import torch
from torch import nn
from torch.nn.utils import prune

from recal_torch import ScheduledModifierManager

from bench.results import machine
from bench.timing import interleaved, medians


class Block(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.short = (nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
                      if stride != 1 or cin != cout else nn.Identity())

    def forward(self, x):
        y = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(y)) + self.short(x))


class SmallResNet(nn.Module):
    def __init__(self, width: int = 32, classes: int = 10):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU())
        self.layers = nn.Sequential(Block(width, width, 1), Block(width, 2 * width, 2), Block(2 * width, 4 * width, 2))
        self.head = nn.Linear(4 * width, classes)

    def forward(self, x):
        return self.head(torch.flatten(nn.functional.adaptive_avg_pool2d(self.layers(self.stem(x)), 1), 1))


def _step(model, optimizer, x, y) -> None:
    optimizer.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    optimizer.step()


def _recipe(update_every_step: bool) -> str:
    frequency = -1 if update_every_step else 1000
    return f"""
- !EpochRangeModifier {{start_epoch: 0, end_epoch: 100}}
- !GradualKSModifier {{params: __ALL_PRUNABLE__, init_sparsity: 0.5, final_sparsity: 0.9, start_epoch: 0,
                       end_epoch: 50, update_frequency: {frequency}}}
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    x, y = torch.randn(32, 3, 32, 32), torch.randint(0, 10, (32,))

    def plain(model):
        return torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

    managers = {}

    def recal(every_step):
        def setup(model):
            manager = ScheduledModifierManager.from_yaml(_recipe(every_step))
            managers[every_step] = manager
            return manager.modify(model, plain(model), steps_per_epoch=1)
        return setup

    def torch_prune(model):
        for module in model.modules():
            if isinstance(module, (nn.Conv2d, nn.Linear)):
                prune.l1_unstructured(module, "weight", amount=0.5)
        return plain(model)

    variants = {"plain": plain, "recal, between updates": recal(False),
                "recal, mask update every step": recal(True), "torch.nn.utils.prune": torch_prune}
    models, steps = {}, {}
    for name, setup in variants.items():
        torch.manual_seed(0)
        models[name] = model = SmallResNet()
        steps[name] = lambda model=model, optimizer=setup(model): _step(model, optimizer, x, y)
    results = medians(interleaved(steps, args.steps, warmup=3))  # one step of each per round, in turn

    # the masking work alone, timed apart from the step (robust to step-time noise)
    manager = managers[False]

    def recal_work():  # what recal's step hooks do between mask updates
        manager._before_step()
        manager.masks.apply()
        manager._apply_state(manager.step)
        manager.masks.update(manager.step)

    pruned = [m for m in models["torch.nn.utils.prune"].modules() if hasattr(m, "weight_mask")]

    def prune_work():  # what prune's forward pre-hook does each forward (its backward adds a mul too)
        for m in pruned:
            setattr(m, "weight", m.weight_orig * m.weight_mask)

    alone = medians(interleaved({"recal masking work alone": recal_work,
                                 "torch.nn.utils.prune hook work alone (fwd)": prune_work}, args.steps, warmup=0))
    base = results["plain"]
    print(f"\nSmallResNet, batch 32, 32x32, {machine()['cpu']}, {args.threads} threads, median of {args.steps} "
          "interleaved steps")
    print(f"{'variant':44s} {'ms/step':>9s} {'vs plain':>9s}")
    for name, value in results.items():
        print(f"{name:44s} {value * 1e3:9.2f} {100 * (value / base - 1):+8.1f}%")
    for name, value in alone.items():
        print(f"{name:44s} {value * 1e3:9.3f} {100 * value / base:+8.2f}%")


if __name__ == "__main__":
    main()
