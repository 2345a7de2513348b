"""What a layer's precision costs in time, on this CPU: each candidate of a planned layer
(:mod:`recal_core.precision_plan`) timed alone in onnxruntime as the converted model runs it: a weight-only
Linear's ``MatMulNBits`` at 2, 4 or 8 bits (``quantize_qat_export``'s weight-only form) or its float ``MatMul``;
under the ``w8a8`` scheme a convolution's ``QLinearConv`` or float ``Conv`` at its geometry and one sample's input,
a Linear's ``QGemm`` or float ``MatMul``. A plan that mixes int8 and float layers also pays a Quantize or a
Dequantize where they meet; that is not in a layer's time.

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
from recal_core.precision_plan import FLOAT, ConvGeometry, LayerCandidates, matmul_shape

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
    rng = np.random.default_rng(0)
    block = _block(in_features, group_size)
    models = {b: _model(rows, in_features, out_features, b, block, bias, accuracy_level, rng) for b in bits}
    return _timed(models, {"x": rng.standard_normal((rows, in_features)).astype(np.float32)}, threads, rounds)


def _timed(models: dict, feed: dict, threads: int | None, rounds: int = 9) -> dict[int, float]:
    """Each model's median milliseconds a run on ``feed`` (uint8 where the model's input is), interleaved."""
    from .sessions import session

    runs = {}
    for b, model in models.items():
        s = session(model, threads=threads)
        x = {k: (v if s.get_inputs()[0].type == "tensor(float)" else np.clip(v * 40 + 128, 0, 255).astype(np.uint8))
             for k, v in feed.items()}
        for _ in range(3):
            s.run(None, x)
        start = time.perf_counter()
        s.run(None, x)
        once = max(time.perf_counter() - start, 1e-6)
        runs[b] = (s, x, max(1, min(1000, int(0.002 / once))))
    times = {b: [] for b in models}
    for _ in range(rounds):
        for b, (s, x, repeat) in runs.items():
            start = time.perf_counter()
            for _ in range(repeat):
                s.run(None, x)
            times[b].append((time.perf_counter() - start) / repeat * 1e3)
    return {b: statistics.median(t) for b, t in times.items()}


def _int8_model(rows: int, k: int, n: int, bits: int, bias: bool, conv: ConvGeometry | None, groups: int,
                rng: np.random.Generator):
    """A ``w8a8`` layer as the converter writes it: ``QLinearConv`` / ``QGemm`` (uint8 in and out, int8 weights
    per channel), or its float ``Conv`` / ``MatMul`` (``bits`` 32)."""
    from onnx import TensorProto, helper, numpy_helper

    shape = _input_shape(rows, k, conv)
    wshape = [n, k] if conv is None else [n, k // groups, *conv.kernel]
    attrs = {} if conv is None else {"kernel_shape": list(conv.kernel), "strides": list(conv.stride),
                                     "pads": list(conv.padding) * 2, "dilations": list(conv.dilation), "group": groups}
    out = [rows, n] if conv is None else [1, n, *conv.output()]
    w = rng.standard_normal(wshape).astype(np.float32)
    if bits == FLOAT:
        inits = [numpy_helper.from_array(w if conv is not None else w.T.copy(), "w")]
        names = ["x", "w"] + (["b"] if bias and conv is not None else [])
        if bias:
            inits.append(numpy_helper.from_array(rng.standard_normal(n).astype(np.float32), "b"))
        nodes = [helper.make_node("Conv", names, ["y"], **attrs) if conv is not None else
                 helper.make_node("MatMul", ["x", "w"], ["y" if not bias else "m"])]
        if bias and conv is None:
            nodes.append(helper.make_node("Add", ["m", "b"], ["y"]))
        dtype = TensorProto.FLOAT
    else:
        inits = [numpy_helper.from_array(v, name) for name, v in [
            ("xs", np.array(0.02, np.float32)), ("xz", np.array(128, np.uint8)),
            ("w", rng.integers(-127, 128, wshape, dtype=np.int8)), ("ws", np.full(n, 0.01, np.float32)),
            ("wz", np.zeros(n, np.int8)), ("ys", np.array(0.05, np.float32)),
            ("yz", np.array(128, np.uint8)), ("b", rng.integers(-1000, 1000, n, dtype=np.int32))]]
        if conv is not None:
            nodes = [helper.make_node("QLinearConv", ["x", "xs", "xz", "w", "ws", "wz", "ys", "yz"]
                                      + (["b"] if bias else []), ["y"], **attrs)]
        else:
            nodes = [helper.make_node("QGemm", ["x", "xs", "xz", "w", "ws", "wz", "b" if bias else "", "ys", "yz"],
                                      ["y"], domain="com.microsoft", transB=1)]
        dtype = TensorProto.UINT8
    graph = helper.make_graph(nodes, "layer", [helper.make_tensor_value_info("x", dtype, shape)],
                              [helper.make_tensor_value_info("y", dtype, out)], inits)
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    return helper.make_model(graph, opset_imports=opsets)


def _input_shape(rows: int, k: int, conv: ConvGeometry | None) -> list[int]:
    """A ``w8a8`` layer's input: ``rows`` of ``k`` (a Linear), or one sample of ``k`` channels (a convolution)."""
    return [rows, k] if conv is None else [1, k, *conv.spatial]


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
        layers: the measured layers (:func:`recal_torch.measure_precision`), each with its shape (under
            ``scheme="w8a8"`` a convolution's geometry: timed as ``QLinearConv`` or ``Conv``; a Linear's
            ``QGemm`` or ``MatMul``).
        group_size: weights per scale, as the layers were measured (weight-only layers).
        rows: input rows to time each layer at (1: a decoder's one-token step); None: each layer's rows for one
            sample of the calibration data.
        accuracy_level: ``MatMulNBits``' accuracy level, as the model will be converted (4: int8 inputs, faster on
            most CPUs, inexact).
        threads: intra-op threads (None: onnxruntime's default session, as a user runs it).
        cache: read and keep times in :func:`cache_path` (False: time afresh, keep nothing).
        progress: a progress bar over the shapes timed.
    """
    import onnxruntime as ort

    if any(layer.scheme != "w8a8" for layer in layers):
        _block(1, group_size)  # refused before any timing
    missing = [layer.name for layer in layers if not layer.in_features or not layer.out_features]
    if missing:
        raise ValueError(f"{', '.join(missing[:5])}: no shape to time (in_features / out_features unset); measure the "
                         "layers with a front end's measure_precision")
    path = cache_path()
    kept = _read_cache(path) if cache else {}
    machine = f"{describe()}|onnxruntime {ort.__version__}|threads {threads or 'default'}"
    where = f"{machine}|group {group_size}|level {accuracy_level}"

    def shape(layer: LayerCandidates, c) -> tuple:
        r, k, n = matmul_shape(layer, c)
        if layer.scheme != "w8a8":
            return rows or r, k, n, layer.bias
        groups = 1 if layer.conv is None else layer.conv_groups(k)
        return "w8a8", rows or r, k, n, layer.bias, layer.conv, groups

    def key(at: tuple, b: int) -> str:
        if at[0] != "w8a8":
            return f"{where}|{at[0]}x{at[1]}x{at[2]}|bias {at[3]}|bits {b}"
        _, r, k, n, bias, conv, groups = at
        what = f"qgemm {r}x{k}x{n}" if conv is None else (
            f"conv {k}x{n} kernel {conv.kernel} stride {conv.stride} pads {conv.padding} dilation {conv.dilation} "
            f"groups {groups} at {conv.spatial}")
        return f"{machine}|{what}|bias {bias}|bits {b}"

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
    rng = np.random.default_rng(0)
    for at, bits in items:
        if at[0] == "w8a8":
            _, r, k, n, bias, conv, groups = at
            feed = {"x": rng.standard_normal(_input_shape(r, k, conv)).astype(np.float32)}
            times = _timed({b: _int8_model(r, k, n, b, bias, conv, groups, rng) for b in sorted(bits)}, feed, threads)
        else:
            r, k, n, bias = at
            times = time_candidates(r, k, n, tuple(sorted(bits)), group_size=group_size, bias=bias,
                                    accuracy_level=accuracy_level, threads=threads)
        for b, ms in times.items():
            fresh[key(at, b)] = ms
    if cache and fresh:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomically(path, json.dumps({**kept, **fresh}, indent=0))
    kept.update(fresh)
    return [dataclasses.replace(layer, candidates=tuple(
        dataclasses.replace(c, latency=kept[key(shape(layer, c), c.bits)]) for c in layer.candidates))
        for layer in layers]
