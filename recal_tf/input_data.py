"""A drop-in for the removed ``tensorflow.examples.tutorials.mnist.input_data``, on the bundled digits.

``read_data_sets(...)`` returns ``train`` / ``validation`` / ``test`` sets of 28x28 images
flattened to 784 floats in [0, 1] (scikit-learn's 8x8 digits, upscaled), with ``next_batch``.
MNIST has 55,000 training images and the seed example's settings (batch 1024, Adam at 1e-4) are
made for that; the digits have 1,797. So the training set is 1,024 digits, each in ``shifts``
versions moved by whole pixels in the 28x28 frame (16 by default: 16,384 images, 16 batches of
1024 per epoch, and ``int(n / 1024) == ceil(n / 1024)`` as the example assumes). Validation and
test sets are not shifted. Nothing is downloaded; ``train_dir`` is ignored.
"""

from __future__ import annotations

import numpy as np

from recal_core.datasets import load_digits, upscale

DEFAULT_VALIDATION_SIZE = 413
DEFAULT_SHIFTS = 16
_OFFSETS = [(dy, dx) for dy in (-2, -1, 1, 2) for dx in (-2, -1, 1, 2)]


class DataSet:
    """Images and labels with MNIST's ``next_batch`` (shuffled each epoch, deterministic by seed)."""

    def __init__(self, images: np.ndarray, labels: np.ndarray, seed: int = 0):
        self.images = images
        self.labels = labels
        self._rng = np.random.default_rng(seed)
        self._order = np.arange(len(images))
        self._position = len(images)  # shuffle on first use
        self.epochs_completed = 0

    @property
    def num_examples(self) -> int:
        return len(self.images)

    def next_batch(self, batch_size: int, shuffle: bool = True) -> tuple[np.ndarray, np.ndarray]:
        if batch_size <= 0:
            raise ValueError(f"batch_size must be > 0, got {batch_size}")
        picked: list[np.ndarray] = []
        needed = batch_size
        while needed:
            if self._position >= len(self._order):
                self._order = self._rng.permutation(len(self.images)) if shuffle else np.arange(len(self.images))
                self._position = 0
                self.epochs_completed += 1
            take = self._order[self._position: self._position + needed]
            self._position += len(take)
            needed -= len(take)
            picked.append(take)
        index = np.concatenate(picked)
        return self.images[index], self.labels[index]


class DataSets:
    def __init__(self, train: DataSet, validation: DataSet, test: DataSet):
        self.train, self.validation, self.test = train, validation, test


def read_data_sets(train_dir: str | None = None, one_hot: bool = False,
                   validation_size: int = DEFAULT_VALIDATION_SIZE, shifts: int = DEFAULT_SHIFTS,
                   seed: int = 0) -> DataSets:
    """MNIST-shaped digits: ``train`` (1024 x ``shifts``), ``validation`` (413), ``test`` (360)."""
    digits = load_digits()
    if not 0 <= validation_size < len(digits.train_labels):
        raise ValueError(f"validation_size must be in [0, {len(digits.train_labels)}), got {validation_size}")
    if not 1 <= shifts <= len(_OFFSETS):
        raise ValueError(f"shifts must be in [1, {len(_OFFSETS)}], got {shifts}")

    def labels_of(labels: np.ndarray) -> np.ndarray:
        return np.eye(10, dtype=np.float32)[labels] if one_hot else labels

    cut = len(digits.train_labels) - validation_size
    base = upscale(digits.train_images[:cut])
    moved = [np.roll(base, offset, axis=(1, 2)) for offset in _OFFSETS[:shifts]] if shifts > 1 else [base]
    train_x = np.concatenate(moved).reshape(-1, 28 * 28)
    train_y = labels_of(np.tile(digits.train_labels[:cut], len(moved)))
    val_x = upscale(digits.train_images[cut:]).reshape(-1, 28 * 28)
    test_x = upscale(digits.test_images).reshape(-1, 28 * 28)
    return DataSets(DataSet(train_x, train_y, seed),
                    DataSet(val_x, labels_of(digits.train_labels[cut:]), seed + 1),
                    DataSet(test_x, labels_of(digits.test_labels), seed + 2))
