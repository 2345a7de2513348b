"""TensorBoard logging of recal's scalars, written with tensorboard's own record format and protos."""

from __future__ import annotations

import os
import socket
import time
from typing import Mapping


class _EventFile:
    """One TensorBoard event file (``events.out.tfevents.*``) of scalars, as ``SummaryWriter.add_scalar`` writes
    them. Not ``torch.utils.tensorboard`` itself: it loads tensorboard's TensorFlow shim, which imports all of
    TensorFlow wherever it is installed (about 5 s at the start of every PyTorch run)."""

    def __init__(self, log_dir: str | os.PathLike):
        from tensorboard.compat.proto import event_pb2, summary_pb2
        from tensorboard.summary.writer.record_writer import RecordWriter

        self._event, self._summary = event_pb2.Event, summary_pb2.Summary
        os.makedirs(log_dir, exist_ok=True)
        name = f"events.out.tfevents.{int(time.time()):010d}.{socket.gethostname()}.{os.getpid()}.recal"
        self._records = RecordWriter(open(os.path.join(log_dir, name), "wb"))
        self._write(self._event(wall_time=time.time(), file_version="brain.Event:2"))

    def _write(self, event) -> None:
        self._records.write(event.SerializeToString())

    def add_scalar(self, tag: str, value: float, global_step: int) -> None:
        value = self._summary.Value(tag=tag, simple_value=float(value))
        self._write(self._event(wall_time=time.time(), step=global_step, summary=self._summary(value=[value])))

    def flush(self) -> None:
        self._records.flush()

    def close(self) -> None:
        if not self._records.closed:
            self._records.close()


class TensorBoardLogger:
    """Writes the scalars of every step (or every ``every`` steps) as TensorBoard scalars.

    Give a log directory (a new event file there) or an existing writer with ``add_scalar``, ``flush`` and
    ``close`` (a ``torch.utils.tensorboard.SummaryWriter``); ``close()`` flushes the files.
    """

    def __init__(self, log_dir: str | os.PathLike | None = None, writer=None, every: int = 1):
        if (log_dir is None) == (writer is None):
            raise ValueError("give exactly one of log_dir or writer")
        if every < 1:
            raise ValueError(f"every must be >= 1, got {every}")
        self.writer = writer if writer is not None else _EventFile(log_dir)
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
