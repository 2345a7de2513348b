"""What a Linear layer's weight precision costs in time, on this CPU: each candidate of a planned layer
(:mod:`recal_core.precision_plan`) timed alone in onnxruntime as the converted model runs it, a ``MatMulNBits`` of
the layer's shape at 2, 4 or 8 bits (``quantize_qat_export``'s weight-only form) or its float ``MatMul``.

Fewer bytes is not less time: ``MatMulNBits`` at 2 and 8 bits runs slower than at 4 on x86 today, and a small
layer's float ``MatMul`` can beat all three. So a latency budget is planned from times, not sizes. Each shape's
candidates are timed together, in interleaved rounds (median), in a default session (the one a user runs) or on
``threads``; the values of the weights do not change a kernel's time, so the weights are random. Times are cached
per CPU, onnxruntime version, threads and shape in ``$RECAL_CACHE`` (else ``~/.cache/recal``)
``/layer_latency.json``, so planning again does not time again; ``cache=False`` times afresh.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import time
import warnings
from pathlib import Path

import numpy as np

from recal_core.atomic import write_text_atomically
from recal_core.precision_plan import FLOAT, LayerCandidates, matmul_shape

from .cpu import describe
from .passes import nbits_block

CACHE_NAME = "layer_latency.json"
MAX_CACHE_BYTES = 16 << 20  # a cache grown past this is started again, not read


def cache_path() -> Path:
    """Where timed layers are kept: ``$RECAL_CACHE/layer_latency.json``, else ``~/.cache/recal/``."""
    return Path(os.environ.get("RECAL_CACHE") or Path.home() / ".cache" / "recal") / CACHE_NAME


def _model(rows: int, k: int, n: int, bits: int, block: int, bias: bool, level: int, rng: np.random.Generator):
    from onnx import TensorProto, helper, numpy_helper

    inputs, inits = ["x"], []
    if bits == FLOAT:
        inits.append(numpy_helper.from_array(rng.standard_normal((k, n)).astype(np.float32), "w"))
        nodes = [helper.make_node("MatMul", ["x", "w"], ["y" if not bias else "m"])]
        if bias:
            inits.append(numpy_helper.from_array(rng.standard_normal(n).astype(np.float32), "b"))
            nodes.append(helper.make_node("Add", ["m", "b"], ["y"]))
    else:
        blocks = -(-k // block)
        packed = rng.integers(0, 256, (n, blocks, block * bits // 8), dtype=np.uint8)
        inits += [numpy_helper.from_array(packed, "w"),
                  numpy_helper.from_array(rng.uniform(0.01, 0.1, n * blocks).astype(np.float32), "s")]
        inputs += ["w", "s"]
        if bias:
            inits.append(numpy_helper.from_array(rng.standard_normal(n).astype(np.float32), "b"))
            inputs += ["", "", "b"]
        nodes = [helper.make_node("MatMulNBits", inputs, ["y"], domain="com.microsoft", K=k, N=n, bits=bits,
                                  block_size=block, accuracy_level=level)]
        inputs = ["x"]
    graph = helper.make_graph(nodes, "layer", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [rows, k])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [rows, n])], inits)
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    return helper.make_model(graph, opset_imports=opsets)


def time_candidates(rows: int, in_features: int, out_features: int, bits: tuple[int, ...], *, group_size: int = 32,
                    bias: bool = False, accuracy_level: int = 0, threads: int | None = None,
                    rounds: int = 9) -> dict[int, float]:
    """Milliseconds per run of one layer of this shape at each of ``bits`` (32: float), timed together in
    interleaved rounds, the median of each.

    Args:
        rows: the layer's input rows for one sample (tokens, or 1).
        in_features: the layer's inputs.
        out_features: the layer's outputs.
        bits: the candidates: 2, 4, 8 (``MatMulNBits``) and 32 (float ``MatMul``).
        group_size: weights per scale (0: one per output channel), run in the block the converter writes.
        bias: the layer adds a bias.
        accuracy_level: ``MatMulNBits``' accuracy level, as ``quantize_qat_export(accuracy_level=...)`` writes it.
        threads: intra-op threads (onnxruntime's default session when None).
        rounds: interleaved rounds; each times every candidate for about 2 ms.
    """
    from .sessions import session

    rng = np.random.default_rng(0)
    block = _block(in_features, group_size)
    x = {"x": rng.standard_normal((rows, in_features)).astype(np.float32)}
    runs = {}
    for b in bits:
        s = session(_model(rows, in_features, out_features, b, block, bias, accuracy_level, rng), threads=threads)
        for _ in range(3):
            s.run(None, x)
        start = time.perf_counter()
        s.run(None, x)
        once = max(time.perf_counter() - start, 1e-6)
        runs[b] = (s, max(1, min(1000, int(0.002 / once))))
    times = {b: [] for b in bits}
    for _ in range(rounds):
        for b, (s, repeat) in runs.items():
            start = time.perf_counter()
            for _ in range(repeat):
                s.run(None, x)
            times[b].append((time.perf_counter() - start) / repeat * 1e3)
    return {b: statistics.median(t) for b, t in times.items()}


def _block(in_features: int, group_size: int) -> int:
    """The block the converter writes such a layer in (:func:`recal_onnx.passes.nbits_block`); a ValueError where it
    leaves the layer float."""
    block = nbits_block(in_features, group_size)
    if block is None:
        raise ValueError(f"group_size {group_size}: MatMulNBits runs blocks of a power of two from 16, so the "
                         "converter leaves such layers float; plan with group_size 16, 32, 64, 128 or 0")
    return block


def _read_cache(path: Path) -> dict[str, float]:
    try:
        if path.stat().st_size > MAX_CACHE_BYTES:
            return {}
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        warnings.warn(f"{path}: the layer latency cache does not read ({exc}); the layers are timed again and the "
                      "cache written afresh", stacklevel=3)
        return {}
    if not isinstance(data, dict):
        return {}
    return {k: float(v) for k, v in data.items() if isinstance(k, str) and isinstance(v, (int, float)) and v > 0}


def timed_candidates(layers: list[LayerCandidates], *, group_size: int = 32, rows: int | None = None,
                     accuracy_level: int = 0, threads: int | None = None, cache: bool = True,
                     progress: bool = False) -> list[LayerCandidates]:
    """``layers`` with every candidate's ``latency`` (ms) timed in onnxruntime on this CPU: what
    :func:`recal_core.precision_plan.solve` plans a latency budget with. Layers of one shape are timed once.

    Args:
        layers: the measured layers (:func:`recal_torch.measure_precision`), each with its shape.
        group_size: weights per scale, as the layers were measured.
        rows: input rows to time each layer at (1: a decoder's one-token step); None: each layer's rows for one
            sample of the calibration data.
        accuracy_level: ``MatMulNBits``' accuracy level, as the model will be converted (4: int8 inputs, faster on
            most CPUs, inexact).
        threads: intra-op threads (None: onnxruntime's default session, as a user runs it).
        cache: read and keep times in :func:`cache_path` (False: time afresh, keep nothing).
        progress: a progress bar over the shapes timed.
    """
    import onnxruntime as ort

    _block(1, group_size)  # refused before any timing
    missing = [layer.name for layer in layers if not layer.in_features or not layer.out_features]
    if missing:
        raise ValueError(f"{', '.join(missing[:5])}: no shape to time (in_features / out_features unset); measure the "
                         "layers with a front end's measure_precision")
    path = cache_path()
    kept = _read_cache(path) if cache else {}
    where = (f"{describe()}|onnxruntime {ort.__version__}|threads {threads or 'default'}|group {group_size}"
             f"|level {accuracy_level}")

    def shape(layer: LayerCandidates, c) -> tuple[int, int, int, bool]:
        r, k, n = matmul_shape(layer, c)
        return rows or r, k, n, layer.bias

    def key(at: tuple[int, int, int, bool], b: int) -> str:
        return f"{where}|{at[0]}x{at[1]}x{at[2]}|bias {at[3]}|bits {b}"

    shapes: dict[tuple, set[int]] = {}
    for layer in layers:
        for c in layer.candidates:
            if key(shape(layer, c), c.bits) not in kept:
                shapes.setdefault(shape(layer, c), set()).add(c.bits)
    items = shapes.items()
    if progress and shapes:
        from tqdm import tqdm

        items = tqdm(items, desc="timing layers", unit="shape")
    fresh = {}
    for at, bits in items:
        r, k, n, bias = at
        for b, ms in time_candidates(r, k, n, tuple(sorted(bits)), group_size=group_size, bias=bias,
                                     accuracy_level=accuracy_level, threads=threads).items():
            fresh[key(at, b)] = ms
    if cache and fresh:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomically(path, json.dumps({**kept, **fresh}, indent=0))
    kept.update(fresh)
    return [dataclasses.replace(layer, candidates=tuple(
        dataclasses.replace(c, latency=kept[key(shape(layer, c), c.bits)]) for c in layer.candidates))
        for layer in layers]
