"""The PyTorch trainer behind ``recal train --framework torch``: the digits classifier under a recipe.

Checkpoints (``checkpoints/epoch-N.pt``: model, optimizer with recal's state, history) are written
after every epoch; ``resume`` continues from the last one with the same data order, so the result
is the one an uninterrupted run gives.
"""

from __future__ import annotations

import copy
import logging
import math
import statistics
from pathlib import Path

import torch
from torch import nn

from recal_core.atomic import atomic_path
from recal_core.datasets import load_digits
from recal_core.recipe import Recipe
from .training import (BATCH_SIZE, LEARNING_RATE, Artefact, EpochRecord, TrainingRun, check_finite, epoch_line,
                        epoch_order, median_latency_ms, overall_sparsity, progress_bar)

from recal_torch.export import export_onnx
from recal_torch.flops import count_macs
from recal_torch.loggers import TensorBoardLogger
from recal_torch.manager import ScheduledModifierManager
from recal_torch.checkpoint_file import read_checkpoint_file
from recal_torch.model_params import check_weights, describe_parameters, sparsity
from recal_torch.qat import qat_modules
from recal_torch.thin import thin

log = logging.getLogger(__name__)


class DigitsNet(nn.Module):
    """Conv-BN-ReLU x2, max-pool, Conv-BN-ReLU, global average pool, linear: for 1x8x8 digits."""

    def __init__(self, width: int = 32, classes: int = 10):
        super().__init__()
        self.conv1, self.bn1, self.relu1 = (nn.Conv2d(1, width, 3, padding=1, bias=False), nn.BatchNorm2d(width),
                                            nn.ReLU())
        self.conv2, self.bn2, self.relu2 = (nn.Conv2d(width, width, 3, padding=1, bias=False), nn.BatchNorm2d(width),
                                            nn.ReLU())
        self.pool = nn.MaxPool2d(2)
        self.conv3, self.bn3, self.relu3 = (nn.Conv2d(width, 2 * width, 3, padding=1, bias=False),
                                            nn.BatchNorm2d(2 * width), nn.ReLU())
        self.gap = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(2 * width, classes)

    def forward(self, x):
        x = self.relu2(self.bn2(self.conv2(self.relu1(self.bn1(self.conv1(x))))))
        x = self.relu3(self.bn3(self.conv3(self.pool(x))))
        return self.fc(torch.flatten(self.gap(x), 1))


def _tensors():
    digits = load_digits()
    return (torch.from_numpy(digits.train_images[:, None]), torch.from_numpy(digits.train_labels),
            torch.from_numpy(digits.test_images[:, None]), torch.from_numpy(digits.test_labels))


def _accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    training = model.training
    model.eval()
    with torch.no_grad():
        correct = float((model(x).argmax(1) == y).float().mean())
    model.train(training)
    return correct


def _kernels(model: nn.Module) -> dict[str, nn.Parameter]:
    """The conv/dense kernels, as the core selects them (the same Parameters before and after QAT)."""
    infos, params = describe_parameters(model)
    return {p.name: params[p.name] for p in infos if p.prunable}


def _kernel_sparsity(kernels: dict[str, nn.Parameter]) -> tuple[float, dict[str, float]]:
    layers = {name: sparsity(p) for name, p in kernels.items()}
    return overall_sparsity(layers, {name: p.numel() for name, p in kernels.items()}), layers


def _checkpoints(folder: Path) -> list[Path]:
    return sorted(folder.glob("epoch-*.pt"), key=lambda p: int(p.stem.split("-")[1]))


CHECKPOINT_KEYS = ("epoch", "model", "optimizer", "history", "torch_rng")


def _read_checkpoint(path: Path) -> dict:
    """A checkpoint as data (``weights_only``: a crafted file runs no code), with every key it needs."""
    state = read_checkpoint_file(path, "recal checkpoint")
    missing = [k for k in CHECKPOINT_KEYS if not isinstance(state, dict) or k not in state]
    if missing:
        raise ValueError(f"{path} is not a complete recal checkpoint: it lacks {', '.join(missing)}")
    return state


def train(recipe: Recipe, out_dir: Path, *, epochs: int, seed: int, resume: bool, progress: bool) -> TrainingRun:
    x_train, y_train, x_test, y_test = _tensors()
    steps_per_epoch = math.ceil(len(x_train) / BATCH_SIZE)
    torch.manual_seed(seed)
    model = DigitsNet()
    kernels = _kernels(model)
    manager = ScheduledModifierManager(recipe)
    optimizer = manager.modify(model, torch.optim.SGD(model.parameters(), lr=LEARNING_RATE, momentum=0.9,
                                                      weight_decay=5e-5), steps_per_epoch=steps_per_epoch)
    run = TrainingRun("torch", recipe.source, str(out_dir), epochs, seed, steps_per_epoch)
    ckpt_dir = out_dir / "checkpoints"
    start = 0
    if resume:
        found = _checkpoints(ckpt_dir)
        if not found:
            raise FileNotFoundError(f"--resume: no checkpoint in {ckpt_dir}")
        state = _read_checkpoint(found[-1])
        optimizer.load_state_dict(state["optimizer"])  # recal's state first: it re-creates QAT modules
        check_weights(state["model"], model, str(found[-1]))  # shapes, dtypes, finite: before a weight changes
        model.load_state_dict(state["model"])
        run.history = [EpochRecord(**h) for h in state["history"]]
        start = state["epoch"]
        torch.set_rng_state(state["torch_rng"])
        log.info("resumed from %s (epoch %d, step %d)", found[-1], start, manager.step)
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    tensorboard = TensorBoardLogger(out_dir / "tensorboard")
    manager.loggers = [tensorboard]
    loss_fn = nn.CrossEntropyLoss()
    try:
        for epoch in range(start, epochs):
            order = torch.from_numpy(epoch_order(len(x_train), seed, epoch))
            bar = progress_bar(range(steps_per_epoch), f"torch epoch {epoch + 1}/{epochs}", progress)
            losses, correct = [], 0
            model.train()
            for b in bar:
                index = order[b * BATCH_SIZE:(b + 1) * BATCH_SIZE]
                optimizer.zero_grad()
                logits = model(x_train[index])
                loss = loss_fn(logits, y_train[index])
                loss.backward()
                optimizer.step()
                losses.append(loss.item())
                check_finite("torch", epoch * steps_per_epoch + b + 1, losses[-1])
                correct += int((logits.argmax(1) == y_train[index]).sum())
                if b % 5 == 0 or b == steps_per_epoch - 1:
                    bar.set_postfix(loss=f"{statistics.fmean(losses):.3f}",
                                    acc=f"{correct / min(len(x_train), (b + 1) * BATCH_SIZE):.3f}",
                                    sparsity=f"{_kernel_sparsity(kernels)[0]:.3f}",
                                    lr=f"{optimizer.param_groups[0]['lr']:.4g}")
            record = EpochRecord(epoch + 1, statistics.fmean(losses), correct / len(x_train),
                                 _accuracy(model, x_test, y_test), _kernel_sparsity(kernels)[0],
                                 float(optimizer.param_groups[0]["lr"]))
            check_finite("torch", (epoch + 1) * steps_per_epoch,
                         weights=[p.detach().numpy() for p in model.parameters()])
            run.history.append(record)
            for key in ("loss", "train_accuracy", "test_accuracy", "sparsity"):
                tensorboard.writer.add_scalar(f"epoch/{key}", getattr(record, key), record.epoch)
            with atomic_path(ckpt_dir / f"epoch-{epoch + 1}.pt") as tmp:
                torch.save({"epoch": epoch + 1, "model": model.state_dict(), "optimizer": optimizer.state_dict(),
                            "history": [vars(h) for h in run.history], "torch_rng": torch.get_rng_state()}, tmp)
            if progress:  # after the checkpoint: a printed epoch is a saved one
                print(epoch_line("torch", record, epochs), flush=True)
    finally:
        tensorboard.close()
    manager.finalize(model)
    model.eval()
    run.artefacts = _artefacts(model, kernels, out_dir, x_test, y_test)
    return run


def _artefacts(model: nn.Module, kernels: dict[str, nn.Parameter], out_dir: Path, x_test: torch.Tensor,
               y_test: torch.Tensor) -> list[Artefact]:
    quantized = bool(qat_modules(model))
    overall, layers = _kernel_sparsity(kernels)
    with atomic_path(out_dir / "model.pt") as tmp:
        torch.save(model.state_dict(), tmp)
    one = x_test[:1]
    with torch.no_grad():
        latency = median_latency_ms(lambda: model(one))
    macs, n_params = count_macs(model, one)
    torch_artefact = Artefact("PyTorch model" + (" (QAT, fake-quantized)" if quantized else ""), "torch",
                              str(out_dir / "model.pt"), _accuracy(model, x_test, y_test), overall, layers,
                              (out_dir / "model.pt").stat().st_size, latency, f"torch {torch.__version__}",
                              macs=macs, params=n_params)
    out = [torch_artefact]
    thinned = copy.deepcopy(model)
    try:
        removed = thin(thinned).removed
    except Exception as exc:  # noqa: BLE001 - a model fx cannot trace is exported as it is
        log.info("not thinned: torch.fx cannot trace %s (%s)", type(model).__name__, exc)
        removed = 0
    if removed:  # whole channels are dead: export the thinned model, with fewer multiply-adds
        model = thinned
        with atomic_path(out_dir / "model.thin.pt") as tmp:
            torch.save(model.state_dict(), tmp)
        with torch.no_grad():
            latency = median_latency_ms(lambda: model(one))
        macs, n_params = count_macs(model, one)
        out.append(Artefact(f"PyTorch model, thinned ({removed} channels removed)", "torch",
                            str(out_dir / "model.thin.pt"), _accuracy(model, x_test, y_test),
                            _kernel_sparsity(_kernels(model))[0], {}, (out_dir / "model.thin.pt").stat().st_size,
                            latency, f"torch {torch.__version__}", macs=macs, params=n_params))
    onnx_path = export_onnx(model, one, out_dir / "model.onnx")
    out.append(Artefact(("QAT ONNX export (QDQ)" if quantized else "ONNX export (fp32)")
                        + (", thinned" if removed else ""), "torch", str(onnx_path), qat=quantized,
                        macs=macs, params=n_params))
    return out
