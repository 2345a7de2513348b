"""The bundled real dataset: scikit-learn's handwritten digits (1797 8x8 images), split once, fixed.

Nothing is downloaded: the data ships inside scikit-learn. Its CSV is read directly, without importing
scikit-learn (about a second of every ``recal train`` start); the result equals ``sklearn.datasets.load_digits``.
"""

from __future__ import annotations

import gzip
import importlib.util
from dataclasses import dataclass
from pathlib import Path

import numpy as np

SPLIT_SEED = 0
TEST_SIZE = 360


@dataclass(frozen=True)
class Digits:
    """Images in [0, 1] as float32 ``(N, 8, 8)``, labels int64 ``(N,)``."""

    train_images: np.ndarray
    train_labels: np.ndarray
    test_images: np.ndarray
    test_labels: np.ndarray


def load_digits() -> Digits:
    """The fixed train/test split (1437 / 360) of scikit-learn's digits."""
    table = _digits_table()
    images = (table[:, :-1].reshape(-1, 8, 8) / 16.0).astype(np.float32)
    labels = table[:, -1].astype(np.int64)
    order = np.random.default_rng(SPLIT_SEED).permutation(len(labels))
    test, train = order[:TEST_SIZE], order[TEST_SIZE:]
    return Digits(images[train], labels[train], images[test], labels[test])


def _digits_table() -> np.ndarray:
    """scikit-learn's ``digits.csv.gz`` as ``(1797, 65)`` float64: 64 pixels (0-16), then the label."""
    spec = importlib.util.find_spec("sklearn")  # finds the package without importing it
    if spec is None or spec.origin is None:
        raise ImportError("the bundled digits data needs scikit-learn: pip install scikit-learn")
    path = Path(spec.origin).parent / "datasets" / "data" / "digits.csv.gz"
    if not path.is_file():  # a scikit-learn that keeps its data elsewhere: its own loader
        from sklearn.datasets import load_digits as sklearn_digits
        data = sklearn_digits()
        return np.column_stack([data.data, data.target])
    with gzip.open(path, "rt") as f:
        return np.loadtxt(f, delimiter=",")


def upscale(images: np.ndarray, size: int = 28) -> np.ndarray:
    """Nearest-neighbour upscale of ``(N, 8, 8)`` images to ``(N, size, size)``, centred (MNIST-like)."""
    factor = size // images.shape[-1]
    big = np.kron(images, np.ones((factor, factor), dtype=images.dtype))
    pad = size - big.shape[-1]
    before = pad // 2
    return np.pad(big, ((0, 0), (before, pad - before), (before, pad - before)))
