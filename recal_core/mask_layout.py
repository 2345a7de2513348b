"""Structured masks: which weights a mask removes together, and how groups are ranked, for every backend.

A ``mask_type`` turns a weight (in the canonical ``[out, in, *spatial]`` order; a backend whose
kernels are stored otherwise transposes to it first) into a 2-D *view* and a grouping of it:

- ``unstructured``: every weight on its own, ranked by magnitude;
- ``filter``: whole output channels (rows of ``[out, in * spatial]``), ranked by L2 norm;
- ``head``: whole attention heads: rows of the query, key and value projections and columns of the output
  projection, ranked together (:mod:`recal_core.head_coupling`; per weight it is laid out as ``filter``);
- ``channel``: whole input channels (across every filter and position), ranked by L2 norm;
- ``[a, b]`` blocks (``block4`` is ``[1, 4]``): tiles of ``a`` output channels by ``b`` input channels at
  one spatial position (the view ``[out, spatial * in]``), ranked by mean magnitude;
- ``"N:M"``: in every run of ``M`` input channels at one position, at least ``N`` weights stay (2:4 is what
  sparse tensor cores run); the smallest magnitudes in each run go.

At sparsity ``s``, a grouped mask zeroes ``floor(s * groups + 0.5)`` groups (ties broken by group
position), so the zero count is exact: that many groups times the group size. N:M zeroes
``min(floor(s * M + 0.5), M - N)`` weights of every run.

>>> layout = mask_layout("2:4", (8, 16))
>>> layout.zeros_at(0.5), layout.numel
(64, 128)
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

MaskType = Any  # "unstructured" | "filter" | "channel" | "N:M" | (a, b)
_N_OF_M = re.compile(r"^(\d+):(\d+)$")


def normalise_mask_type(value: Any) -> str | tuple[int, int]:
    """A recipe's ``mask_type`` in canonical form; ``ValueError`` saying what is accepted otherwise."""
    if value in ("unstructured", "filter", "channel", "head"):
        return value
    if value == "block4" or value == "block":
        return (1, 4)
    if isinstance(value, (list, tuple)) and len(value) == 2 and all(
            isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in value):
        if tuple(value) == (1, 1):
            return "unstructured"
        return (int(value[0]), int(value[1]))
    if isinstance(value, str) and _N_OF_M.match(value):
        n, m = map(int, _N_OF_M.match(value).groups())
        if not 1 <= n <= m or m > 1024:
            raise ValueError(f"mask_type {value!r}: N:M needs 1 <= N <= M (at most 1024), N weights kept of every M")
        return value
    raise ValueError(f"mask_type {value!r} is not one recal knows: use unstructured, filter, channel, head, a block "
                     "shape such as [1, 4] (block4), or N:M such as '2:4'")


def max_sparsity(mask_type: str | tuple[int, int]) -> float:
    """The highest sparsity a mask type can reach: (M - N) / M for N:M, else below 1."""
    if isinstance(mask_type, str) and _N_OF_M.match(mask_type):
        n, m = map(int, _N_OF_M.match(mask_type).groups())
        return (m - n) / m
    return 1.0


@dataclass(frozen=True)
class MaskLayout:
    """How one weight is grouped: a permutation and a 2-D view ``[rows, cols]``, then groups of it."""

    mask_type: str | tuple[int, int]
    shape: tuple[int, ...]  # canonical [out, in, *spatial]
    perm: tuple[int, ...]  # axes order before viewing as [rows, cols]
    rows: int
    cols: int
    group_rows: int  # a group is a [group_rows, group_cols] tile of the view
    group_cols: int
    score: str  # "abs" (magnitude, mean over a group) or "l2" (norm of a group)
    n_of_m: tuple[int, int] | None = None

    @property
    def numel(self) -> int:
        return self.rows * self.cols

    @property
    def groups(self) -> int:
        return (self.rows // self.group_rows) * (self.cols // self.group_cols)

    @property
    def group_size(self) -> int:
        return self.group_rows * self.group_cols

    def count(self, sparsity: float) -> int:
        """Groups to zero at ``sparsity`` (for N:M: weights to zero in every run of M)."""
        if self.n_of_m is not None:
            n, m = self.n_of_m
            return min(int(math.floor(sparsity * m + 0.5)), m - n)
        return min(self.groups, int(math.floor(sparsity * self.groups + 0.5)))

    def zeros_at(self, sparsity: float) -> int:
        """The exact number of zeros the mask holds at ``sparsity``."""
        if self.n_of_m is not None:
            return self.count(sparsity) * (self.numel // self.n_of_m[1])
        return self.count(sparsity) * self.group_size


def mask_layout(mask_type: Any, shape: Sequence[int]) -> MaskLayout:
    """The grouping of a weight of canonical ``shape`` (``[out]``, ``[out, in]`` or ``[out, in, *spatial]``)
    under ``mask_type``; ``ValueError`` when the layer cannot take it (a block that does not divide it)."""
    kind = normalise_mask_type(mask_type)
    shape = tuple(int(d) for d in shape)
    if len(shape) < 2:
        if kind != "unstructured":
            raise ValueError(f"mask_type {mask_type!r} needs a weight of 2 or more dimensions, not {list(shape)}")
        return MaskLayout(kind, shape, (0,), 1, shape[0] if shape else 1, 1, 1, "abs")
    out, inp, spatial = shape[0], shape[1], int(np.prod(shape[2:], dtype=np.int64))
    natural = tuple(range(len(shape)))
    # input channels last, so that a row of the view runs along input channels at each position
    in_last = (0, *range(2, len(shape)), 1)
    if kind == "unstructured":
        return MaskLayout(kind, shape, natural, out, inp * spatial, 1, 1, "abs")
    if kind in ("filter", "head"):
        return MaskLayout(kind, shape, natural, out, inp * spatial, 1, inp * spatial, "l2")
    if kind == "channel":
        channel_first = (1, 0, *range(2, len(shape)))
        return MaskLayout(kind, shape, channel_first, inp, out * spatial, 1, out * spatial, "l2")
    if isinstance(kind, tuple):
        a, b = kind
        if out % a or inp % b:
            raise ValueError(f"block {list(kind)} does not divide the layer's [{out} out, {inp} in] channels")
        return MaskLayout(kind, shape, in_last, out, spatial * inp, a, b, "abs")
    n, m = map(int, _N_OF_M.match(kind).groups())
    if inp % m:
        raise ValueError(f"mask_type {kind!r} needs input channels in runs of {m}; the layer has {inp}")
    return MaskLayout(kind, shape, in_last, out, spatial * inp, 1, m, "abs", (n, m))


def mask_numpy(weight: np.ndarray, layout: MaskLayout, count: int) -> np.ndarray:
    """The mask (0/1, ``weight``'s canonical shape) zeroing ``count`` groups (N:M: weights per run), ranked
    as :func:`mask_layout` says, ties by position: the reference every backend's masks equal."""
    view = np.transpose(weight, layout.perm).reshape(layout.rows, layout.cols)
    if layout.n_of_m is not None:
        m = layout.n_of_m[1]
        runs = np.abs(view).reshape(-1, m)
        keep = np.ones_like(runs)
        order = np.argsort(runs, axis=1, kind="stable")[:, :count]
        np.put_along_axis(keep, order, 0, axis=1)
        mask_view = keep.reshape(layout.rows, layout.cols)
    else:
        tiles = np.abs(view).reshape(layout.rows // layout.group_rows, layout.group_rows,
                                     layout.cols // layout.group_cols, layout.group_cols)
        scores = (np.sqrt((tiles ** 2).sum(axis=(1, 3))) if layout.score == "l2" else tiles.mean(axis=(1, 3)))
        flat = np.ones(scores.size, dtype=weight.dtype)
        flat[np.argsort(scores.reshape(-1), kind="stable")[:count]] = 0
        keep = flat.reshape(scores.shape)[:, None, :, None]
        mask_view = np.broadcast_to(keep, tiles.shape).reshape(layout.rows, layout.cols)
    permuted = tuple(weight.shape[a] for a in layout.perm)
    return np.transpose(mask_view.reshape(permuted), np.argsort(layout.perm)).astype(weight.dtype)
