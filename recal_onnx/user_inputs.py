"""The user's own verification data: a ``.npz`` file of inputs by name (``--inputs``), and input shapes for the
dimensions a model leaves open (``--input-shape NAME=1,3,640,640``).

An ``.npz`` is untrusted: it is read with ``allow_pickle=False`` (no object arrays, so no code runs), every member's
uncompressed size is checked against :data:`INPUTS_BYTES` before anything is decompressed, and only numeric and
boolean arrays are taken.
"""

from __future__ import annotations

import os
import zipfile
from pathlib import Path

import numpy as np

from recal_core.input_gate import regular_file

INPUTS_BYTES = 2 * 2**30  # every array of an --inputs file together, uncompressed, at most


def load_inputs(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """The arrays of an ``.npz`` file by name (``np.savez(path, x=images)``), bounded and without pickles."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such inputs file (an .npz of arrays by input name: np.savez)")
    regular_file(path, "inputs file")
    try:
        with zipfile.ZipFile(path) as archive:
            total = sum(info.file_size for info in archive.infolist())
    except zipfile.BadZipFile:
        raise ValueError(f"{path} is not an .npz file (np.savez writes one: np.savez('inputs.npz', x=array))") from None
    if total > INPUTS_BYTES:
        raise ValueError(f"{path}: its arrays take {total / 2**20:.0f} MB uncompressed, more than the "
                         f"{INPUTS_BYTES // 2**20} MB verification inputs may take; keep fewer samples")
    arrays = {}
    try:
        with np.load(path, allow_pickle=False) as data:
            for name in data.files:
                value = data[name]
                if not (np.issubdtype(value.dtype, np.number) or value.dtype == np.bool_):
                    raise ValueError(f"{path}: array {name!r} has dtype {value.dtype}; inputs are numeric arrays")
                arrays[name] = value
    except ValueError as exc:
        if str(exc).startswith(str(path)):
            raise
        raise ValueError(f"{path}: cannot read its arrays ({exc})") from None
    if not arrays:
        raise ValueError(f"{path} holds no arrays")
    return arrays


def parse_shape(text: str) -> tuple[str, list[int]]:
    """``NAME=1,3,640,640`` as ``("NAME", [1, 3, 640, 640])``: every dimension a whole number of at least 1."""
    name, sep, dims = text.rpartition("=")
    if not sep or not name:
        raise ValueError(f"expected NAME=D1,D2,... (an input's name and its dimensions), got {text!r}")
    try:
        shape = [int(d) for d in dims.replace("x", ",").split(",") if d.strip()]
    except ValueError:
        raise ValueError(f"expected whole-number dimensions after {name}=, got {dims!r}") from None
    if not shape or any(d < 1 for d in shape):
        raise ValueError(f"expected dimensions of at least 1 for {name!r}, got {dims!r}")
    return name, shape
