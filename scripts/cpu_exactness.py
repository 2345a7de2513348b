"""Are int8 models exact on every CPU? Run them on one machine, then compare with another machine's run.

onnxruntime's int8 kernels differ by CPU: x86 without VNNI (AVX2) adds pairs of uint8 x int8 products in 16 bits,
VNNI / AMX and Arm in 32. ``quantize_qat_export`` (target ``any``) writes models whose integer results are the same on
all of them; this script checks that on real machines. Each run holds every model's outputs on the same inputs, in a
default session and with optimizations disabled, and what ran them (CPU, its VNNI / AMX flags, onnxruntime)::

    python scripts/cpu_exactness.py run MODEL.int8.onnx [...] --inputs X.npy --out here.npz   # on each machine
    python scripts/cpu_exactness.py compare here.npz there.npz                                # a table

The script needs only numpy and onnxruntime (nothing of recal), so it runs where recal is not installed.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path

import numpy as np


def cpu() -> dict:
    """The CPU's model name and its VNNI / AMX flags (Linux's /proc/cpuinfo; elsewhere the platform's name)."""
    info = Path("/proc/cpuinfo")
    text = info.read_text() if info.exists() else ""
    name = next((line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("model name")),
                platform.processor() or platform.machine())
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), [])
    return {"cpu": name, "int8_flags": sorted(f for f in flags if "vnni" in f or f == "amx_int8")}


def run(models: list[Path], inputs: Path, out: Path) -> None:
    import onnxruntime as ort

    x = np.load(inputs)
    levels = {"default": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
              "disabled": ort.GraphOptimizationLevel.ORT_DISABLE_ALL}
    outputs = {}
    for path in models:
        for tag, level in levels.items():
            options = ort.SessionOptions()
            options.graph_optimization_level = level
            session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
            outputs[f"{path.name}|{tag}"] = session.run(None, {session.get_inputs()[0].name: x})[0]
    meta = {**cpu(), "onnxruntime": ort.__version__}
    np.savez(out, __meta__=np.array(json.dumps(meta)), **outputs)
    print(f"{out}: {len(models)} models on {meta['cpu']} ({' '.join(meta['int8_flags']) or 'no VNNI / AMX'}), "
          f"onnxruntime {meta['onnxruntime']}")


MAX_BYTES = 512 * 2**20  # the outputs a run may hold once inflated (a run file comes from another machine)
MAX_ENTRIES = 10_000


class RunFileError(ValueError):
    """A run file this script cannot compare; the message names the file and why."""


def load_run(path: Path) -> tuple[dict, dict[str, np.ndarray]]:
    """A run file's metadata and outputs, checked as untrusted data: a regular ``.npz`` file, no pickled objects,
    at most :data:`MAX_BYTES` once inflated (each member's declared size read before any is), numeric outputs only,
    metadata with its fields."""
    import zipfile

    if not path.is_file():
        raise RunFileError(f"{path}: not a regular file")
    try:
        with zipfile.ZipFile(path) as archive:
            members = archive.infolist()
            if len(members) > MAX_ENTRIES or sum(m.file_size for m in members) > MAX_BYTES:
                raise RunFileError(f"{path}: holds {len(members)} arrays of {sum(m.file_size for m in members):,} "
                                   f"bytes inflated (at most {MAX_ENTRIES} and {MAX_BYTES:,})")
        with np.load(path, allow_pickle=False) as data:
            arrays = {key: data[key] for key in data.files}
    except (zipfile.BadZipFile, OSError, ValueError, EOFError) as exc:
        if isinstance(exc, RunFileError):
            raise
        raise RunFileError(f"{path}: not a run file of this script ({type(exc).__name__}: {exc})") from None
    try:
        meta = json.loads(str(arrays.pop("__meta__")))
        if not isinstance(meta, dict) or not isinstance(meta.get("cpu"), str) or not isinstance(
                meta.get("onnxruntime"), str) or not isinstance(meta.get("int8_flags"), list):
            raise ValueError("fields missing")
    except (KeyError, ValueError, RecursionError) as exc:  # RecursionError: JSON nested deeper than Python follows
        why = "nested deeper than a JSON parser can follow" if isinstance(exc, RecursionError) else str(exc)
        raise RunFileError(f"{path}: its metadata (__meta__: cpu, int8_flags, onnxruntime) is missing or malformed "
                           f"({why})") from None
    for key, value in arrays.items():
        if value.dtype.kind not in "biuf":
            raise RunFileError(f"{path}: output {key!r} holds {value.dtype} values, not numbers")
    return meta, arrays


def _cell(text: str) -> str:
    """``text`` as one markdown table cell (a name from another machine)."""
    return " ".join(str(text).split()).replace("|", "\\|")


def compare(a: Path, b: Path) -> str:
    (meta_a, first), (meta_b, second) = load_run(a), load_run(b)
    lines = ["| model | session | max abs difference | values equal |", "|---|---|---:|---:|"]
    for key in sorted(first):
        model, _, session = key.partition("|")
        row = f"| {_cell(model)} | {_cell(session)} |"
        if key not in second:
            lines.append(f"{row} missing in {_cell(b.name)} | |")
            continue
        x, y = first[key], second[key]
        if x.shape != y.shape:  # never broadcast: outputs of different shapes are different outputs
            lines.append(f"{row} shapes differ: {list(x.shape)} and {list(y.shape)} | |")
            continue
        diff = np.abs(x.astype(np.float64) - y.astype(np.float64))
        lines.append(f"{row} {float(diff.max(initial=0.0)):.3g} | {float(np.mean(x == y)) if x.size else 1.0:.4f} |")
    said = [f"{_cell(m['cpu'])} ({' '.join(map(_cell, m['int8_flags'])) or 'no VNNI / AMX'}), onnxruntime "
            f"{_cell(m['onnxruntime'])}" for m in (meta_a, meta_b)]
    return "\n".join(lines) + f"\n\n{_cell(a.name)}: {said[0]}; {_cell(b.name)}: {said[1]}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="run the models here and save their outputs")
    r.add_argument("models", nargs="+", type=Path)
    r.add_argument("--inputs", type=Path, required=True, help="a .npy array: the models' one input")
    r.add_argument("--out", type=Path, required=True)
    c = sub.add_parser("compare", help="compare two runs")
    c.add_argument("first", type=Path)
    c.add_argument("second", type=Path)
    args = parser.parse_args(argv)
    if args.command == "run":
        run(args.models, args.inputs, args.out)
        return 0
    try:
        print(compare(args.first, args.second))
    except RunFileError as exc:
        print(f"cpu_exactness compare: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
