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


def compare(a: Path, b: Path) -> str:
    first, second = np.load(a), np.load(b)
    metas = [json.loads(str(f["__meta__"])) for f in (first, second)]
    lines = ["| model | session | max abs difference | values equal |", "|---|---|---:|---:|"]
    for key in sorted(k for k in first.files if k != "__meta__"):
        if key not in second.files:
            lines.append(f"| {key.split('|')[0]} | {key.split('|')[1]} | missing in {b.name} | |")
            continue
        x, y = first[key], second[key]
        lines.append(f"| {key.split('|')[0]} | {key.split('|')[1]} | {float(np.abs(x - y).max()):.3g} | "
                     f"{float(np.mean(x == y)):.4f} |")
    said = [f"{m['cpu']} ({' '.join(m['int8_flags']) or 'no VNNI / AMX'}), onnxruntime {m['onnxruntime']}"
            for m in metas]
    return "\n".join(lines) + f"\n\n{a.name}: {said[0]}; {b.name}: {said[1]}"


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
    else:
        print(compare(args.first, args.second))
    return 0


if __name__ == "__main__":
    sys.exit(main())
