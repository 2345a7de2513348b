"""The logger interface both backends feed every step, and a Python ``logging`` logger."""

from __future__ import annotations

import logging
from typing import Mapping, Protocol, runtime_checkable


@runtime_checkable
class RecalLogger(Protocol):
    """Receives, after each optimizer step, the scalars in force: per-layer sparsity (measured and
    target), LR, weight decay, QAT state. Keys look like ``sparsity/conv1.weight``, ``lr``."""

    def log_scalars(self, step: int, epoch: float, scalars: Mapping[str, float]) -> None:
        """Receive the scalars in force after optimizer step ``step``.

        Args:
            step: the optimizer step just taken.
            epoch: the recipe's (fractional) epoch at that step.
            scalars: name to value: ``sparsity/<param>``, ``lr``, ``weight_decay``, ..."""


class PythonLogger:
    """Writes the scalars to a ``logging`` logger every ``every`` steps (INFO level)."""

    def __init__(self, logger: logging.Logger | None = None, every: int = 1, level: int = logging.INFO):
        if every < 1:
            raise ValueError(f"every must be >= 1, got {every}")
        self.logger = logger or logging.getLogger("recal")
        self.every = every
        self.level = level

    def log_scalars(self, step: int, epoch: float, scalars: Mapping[str, float]) -> None:
        """Log the scalars as one line every ``every`` steps.

        Args:
            step: the optimizer step just taken.
            epoch: the recipe's (fractional) epoch at that step.
            scalars: name to value."""
        if step % self.every == 0:
            text = " ".join(f"{k}={v:.6g}" for k, v in sorted(scalars.items()))
            self.logger.log(self.level, "step %d (epoch %.3f): %s", step, epoch, text)
