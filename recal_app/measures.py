"""What the trainers and the ONNX artefacts measure alike: latency and weight sparsity."""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable


def median_latency_ms(call: Callable[[], Any], repeat: int = 200, warmup: int = 10) -> float:
    """Median wall time of ``call()`` in milliseconds, after ``warmup`` untimed calls."""
    for _ in range(warmup):
        call()
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        call()
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e3


def overall_sparsity(layers: dict[str, float], sizes: dict[str, int]) -> float | None:
    """Zero fraction over all the layers together (each layer weighted by its size); None (unknown) when no
    weight was found: never a 0.0 that a reader would take for a measurement."""
    total = sum(sizes[name] for name in layers)
    return sum(layers[name] * sizes[name] for name in layers) / total if total else None
