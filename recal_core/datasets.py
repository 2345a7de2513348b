"""The bundled real dataset: scikit-learn's handwritten digits (1797 8x8 images), split once, fixed.

Nothing is downloaded: the data ships inside scikit-learn.
"""

from __future__ import annotations

from dataclasses import dataclass

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
    try:
        from sklearn.datasets import load_digits as sklearn_digits
    except ImportError:
        raise ImportError("the bundled digits data needs scikit-learn: pip install scikit-learn") from None
    data = sklearn_digits()
    images = (data.images / 16.0).astype(np.float32)
    labels = data.target.astype(np.int64)
    order = np.random.default_rng(SPLIT_SEED).permutation(len(labels))
    test, train = order[:TEST_SIZE], order[TEST_SIZE:]
    return Digits(images[train], labels[train], images[test], labels[test])


def upscale(images: np.ndarray, size: int = 28) -> np.ndarray:
    """Nearest-neighbour upscale of ``(N, 8, 8)`` images to ``(N, size, size)``, centred (MNIST-like)."""
    factor = size // images.shape[-1]
    big = np.kron(images, np.ones((factor, factor), dtype=images.dtype))
    pad = size - big.shape[-1]
    before = pad // 2
    return np.pad(big, ((0, 0), (before, pad - before), (before, pad - before)))
