"""TensorBoard logging of recal's scalars through ``torch.utils.tensorboard``."""

from __future__ import annotations

import os
from typing import Mapping


class TensorBoardLogger:
    """Writes the scalars of every step (or every ``every`` steps) as TensorBoard scalars.

    Give a log directory or an existing ``SummaryWriter``; ``close()`` flushes the files.
    """

    def __init__(self, log_dir: str | os.PathLike | None = None, writer=None, every: int = 1):
        if (log_dir is None) == (writer is None):
            raise ValueError("give exactly one of log_dir or writer")
        if every < 1:
            raise ValueError(f"every must be >= 1, got {every}")
        if writer is None:
            from torch.utils.tensorboard import SummaryWriter

            writer = SummaryWriter(log_dir=str(log_dir))
        self.writer = writer
        self.every = every

    def log_scalars(self, step: int, epoch: float, scalars: Mapping[str, float]) -> None:
        """Add the scalars (under ``recal/``) to TensorBoard every ``every`` steps.

        Args:
            step: the optimizer step just taken (TensorBoard's global step).
            epoch: the recipe's (fractional) epoch, written as ``recal/epoch``.
            scalars: name to value."""
        if step % self.every:
            return
        for key, value in scalars.items():
            self.writer.add_scalar(f"recal/{key}", value, global_step=step)
        self.writer.add_scalar("recal/epoch", epoch, global_step=step)

    def close(self) -> None:
        """Flush and close the TensorBoard writer."""
        self.writer.flush()
        self.writer.close()
