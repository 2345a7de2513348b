"""One gate for every file recal reads from a user (recipes, checkpoints, ONNX models, comparison data): a regular
file, and no more than a limit read, counted while reading. A FIFO would block the reader forever and a device
(``/dev/zero``) report size 0 and then never end; ``stat`` alone cannot bound either, so the gate refuses anything
but a regular file before opening it and stops reading one byte past the limit."""

from __future__ import annotations

import os
import stat
from pathlib import Path
from .errors import InputFileError


def regular_file(path: str | os.PathLike, what: str = "file") -> Path:
    """``path`` (symlinks followed) if it is a regular file; :class:`InputFileError` (FileNotFoundError where it does
    not exist) otherwise."""
    path = Path(path)
    mode = os.stat(path).st_mode  # FileNotFoundError as it is
    if not stat.S_ISREG(mode):
        kind = ("a directory" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode) else
                "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "a socket" if stat.S_ISSOCK(mode)
                else "not a regular file")
        raise InputFileError(f"{path}: the {what} is {kind}, not a regular file")
    return path


def read_bounded(path: str | os.PathLike, limit: int, what: str = "file") -> bytes:
    """The bytes of the regular file ``path``, refused (:class:`InputFileError`) once more than ``limit`` are read,
    whatever its size claims."""
    path = regular_file(path, what)
    with open(path, "rb") as handle:
        data = handle.read(limit + 1)
    if len(data) > limit:
        raise InputFileError(f"{path}: the {what} is over {limit:,} bytes")
    return data


def refuse_overwriting(output: str | os.PathLike, inputs: list[str | os.PathLike], what: str = "output") -> None:
    """Raise ValueError when ``output`` is one of ``inputs`` however spelled: the same path, a symlink to it, or a
    hard link (the same device and inode)."""
    target = Path(output)
    if not target.exists():
        return
    for source in inputs:
        try:
            if os.path.samefile(target, source):
                raise ValueError(f"refusing to write the {what} {target}: it is the input {source} (the same "
                                 "file); choose another path")
        except FileNotFoundError:
            continue
