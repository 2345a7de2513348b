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
        if step % self.every:
            return
        for key, value in scalars.items():
            self.writer.add_scalar(f"recal/{key}", value, global_step=step)
        self.writer.add_scalar("recal/epoch", epoch, global_step=step)

    def close(self) -> None:
        self.writer.flush()
        self.writer.close()
