"""One way to time: the variants take turns in a rotating order, so that drift on a shared machine touches them
alike, and each reports its median.

Timings on a 2-core machine are noisy: compare variants measured in one run, as ratios of medians, never figures
from two runs.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping
from pathlib import Path

import numpy as np


def interleaved(calls: Mapping[str, Callable[[], object]], rounds: int, per_round: int = 1, warmup: int = 1,
                repeat: Mapping[str, int] | None = None) -> dict[str, list[float]]:
    """Seconds of each call, ``rounds`` rounds in which every call runs ``per_round`` samples in turn (the first
    of a round moves on by one each round). A sample of a call runs it ``repeat[name]`` times (a millisecond call
    timed once is mostly noise) and records the mean. ``warmup`` untimed calls of each come first."""
    for call in calls.values():
        for _ in range(warmup):
            call()
    times: dict[str, list[float]] = {name: [] for name in calls}
    order = list(calls)
    for r in range(rounds):
        for name in order[r % len(order):] + order[:r % len(order)]:
            n = (repeat or {}).get(name, 1)
            for _ in range(per_round):
                t0 = time.perf_counter()
                for _ in range(n):
                    calls[name]()
                times[name].append((time.perf_counter() - t0) / n)
    return times


def medians(times: Mapping[str, list[float]], scale: float = 1.0) -> dict[str, float]:
    """Each variant's median, times ``scale`` (1e3: milliseconds)."""
    return {name: statistics.median(values) * scale for name, values in times.items()}


def seconds(call: Callable[[], object]) -> tuple[object, float]:
    """``call()``'s result and the seconds it took."""
    t0 = time.perf_counter()
    result = call()
    return result, time.perf_counter() - t0


def _runs(sessions: Mapping, feed: dict[str, np.ndarray], min_seconds: float) -> tuple[dict, dict]:
    """A call of each session on ``feed`` (run once, untimed) and how many runs fill ``min_seconds``."""
    repeat = {}
    for key, s in sessions.items():
        s.run(None, feed)
        _, once = seconds(lambda s=s: s.run(None, feed))
        repeat[key] = max(1, int(min_seconds / max(once, 1e-6)))
    return {key: (lambda s=s: s.run(None, feed)) for key, s in sessions.items()}, repeat


def interleaved_latency(paths: Mapping[str, Path], feed: dict[str, np.ndarray], rounds: int = 15, per_round: int = 3,
                        threads: int = 1, min_seconds: float = 0.0, sessions: int = 1) -> dict[str, float]:
    """Median batch latency (ms) of each ONNX model in onnxruntime sessions (default optimizations) on ``threads``,
    interleaved; each sample runs a model as many times as fill ``min_seconds``. With ``sessions`` > 1 each model
    runs in that many sessions of its own, every one taking its turn each round, and its median is over all their
    samples: sessions of one file differ by up to 8% (four sessions of a 0.2 ms model, interleaved, AMD EPYC), a
    bias that interleaving alone cannot remove."""
    from recal_onnx import session

    built = {(k, j): session(str(p), threads) for k, p in paths.items() for j in range(sessions)}
    calls, repeat = _runs(built, feed, min_seconds)
    times = interleaved(calls, rounds, per_round, warmup=0, repeat=repeat)
    return medians({k: [t for (name, _), values in times.items() if name == k for t in values] for k in paths}, 1e3)


def in_turns(groups: Mapping[str, tuple[Mapping[str, Path], dict[str, np.ndarray]]], rounds: int, per_round: int = 3,
             threads: int = 1, min_seconds: float = 0.0) -> dict[str, dict[str, float]]:
    """Median batch latency (ms) of every ONNX model of every group (its paths and its feed), the groups taking
    turns round after round and each round in fresh sessions: a burst of noise on a shared machine then hits one
    round of one group rather than all of its rounds (timed one group after another, a 10-second burst moved
    identical small graphs by 30%, AMD EPYC), and no model keeps one session's memory layout throughout."""
    from recal_onnx import session

    times: dict[str, dict[str, list[float]]] = {g: {k: [] for k in paths} for g, (paths, _) in groups.items()}
    for r in range(rounds):
        for group, (paths, feed) in groups.items():
            names = list(paths)[r % len(paths):] + list(paths)[:r % len(paths)]
            calls, repeat = _runs({k: session(str(paths[k]), threads) for k in names}, feed, min_seconds)
            for k, values in interleaved(calls, 1, per_round, warmup=0, repeat=repeat).items():
                times[group][k] += values
            del calls  # the round's sessions
    return {g: medians(t, 1e3) for g, t in times.items()}


def repeated(measure: Callable[[], Mapping[str, Mapping[str, float]]], repeats: int
             ) -> list[Mapping[str, Mapping[str, float]]]:
    """``measure()`` (a whole interleaved run: every group's latency by file) ``repeats`` times: one run cannot tell a
    3% gap from a burst of noise on a shared machine (one zoo row read 0.83x, then 0.97x and 1.04x in reruns)."""
    return [measure() for _ in range(repeats)]


def spread(values: list[float]) -> tuple[float, float, float]:
    """``(minimum, median, maximum)`` of one ratio over repeats."""
    return min(values), statistics.median(values), max(values)
