"""Reading a checkpoint file someone else may have written: as data only, and every failure names the file."""

from __future__ import annotations

import os
import re
from typing import Any

import torch

from recal_core.input_gate import regular_file


def read_checkpoint_file(path: str | os.PathLike, what: str = "checkpoint file") -> Any:
    """``path`` loaded with ``weights_only`` (a crafted pickle runs no code); a file that does not load (code in
    it, truncated, not a torch file) is one ``ValueError`` naming it and the cause.

    Args:
        path: the file.
        what: what it should be, for the message (``"recal checkpoint"``).
    """
    regular_file(path, what)  # a FIFO or a device left in its place would block the load
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - unpickling refuses code, a truncated zip, ... in its own types
        said = " ".join(re.sub(r"\x1b\[[0-9;]*m", "", str(exc)).split())[:200]  # torch's bold, as plain text
        raise ValueError(f"{path} is not a {what} that loads as data ({type(exc).__name__}: {said})") from None
