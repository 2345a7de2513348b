"""The CNN zoo on onnxruntime: fp32 vs recal's int8 (``qoperator``, ``qdq``) vs onnxruntime's ``quantize_static``.

The models of ``tests/zoo/test_cnns.py`` (Hugging Face ResNet, MobileNetV2, EfficientNet, ConvNeXt from small
configs; torchvision-style ResNet / MobileNetV2 / Inception blocks), random weights, nothing downloaded. Each
is pruned 80% and QAT-trained for a few steps on synthetic 32x32 data, exported at ``--size`` (QDQ) and
converted by ``quantize_qat_export``; the float model (same seed, not trained) is exported and quantized by
onnxruntime's ``quantize_static`` (QDQ, uint8 activations, int8 per-channel weights, after ``quant_pre_process``,
calibrated on 8 synthetic inputs).

One table: median latency at batch 1, 1 thread (every model in turn, round after round), size, the float ops
left in recal's ``qoperator`` model (op x count, by design or not) and fidelity: the largest difference of the
logits from the QAT export run as float QDQ (optimizations off) on 64 inputs, for recal's int8 and for
onnxruntime's own int8 execution of that same QDQ export. Run it on an idle machine: it measures latency.

    python scripts/bench_zoo.py [--quick] [--rounds 15] [--size 224] [--models hf-resnet-basic ...]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import warnings
from pathlib import Path

import numpy as np
import onnxruntime as ort
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))
from bench_transformers import interleaved_latency, ort_quantized  # noqa: E402
from recal_onnx import quantize_qat_export  # noqa: E402
from recal_torch import export_onnx  # noqa: E402
from tests.zoo.test_cnns import MODELS, prune_and_qat  # noqa: E402


def run_float_qdq(path: Path, feeds: dict[str, np.ndarray]) -> np.ndarray:
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"]).run(None, feeds)[0]


def bench(name: str, size: int, rounds: int, folder: Path) -> dict:
    folder.mkdir()
    sample = torch.randn(1, 3, size, size)
    torch.manual_seed(0)
    fp32 = export_onnx(MODELS[name][0]().eval(), sample, folder / "fp32.onnx")
    qat = export_onnx(prune_and_qat(name), sample, folder / "qat.onnx")
    rng = np.random.default_rng(0)
    checks = {"input": rng.standard_normal((64, 3, size, size)).astype(np.float32)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        recal = {fmt: quantize_qat_export(str(qat), folder / f"{fmt}.onnx", format=fmt, verify_inputs=checks,
                                          tolerance=float("inf")) for fmt in ("qoperator", "qdq")}
    calibration = [{"input": rng.standard_normal((1, 3, size, size)).astype(np.float32)} for _ in range(8)]
    static = ort_quantized(fp32, folder, calibration, dynamic=False)["ort quantize_static"][0]
    paths = {"fp32": fp32, "recal qoperator": folder / "qoperator.onnx", "recal qdq": folder / "qdq.onnx",
             "ort quantize_static": static}
    latency = interleaved_latency(paths, {"input": sample.numpy()}, 1, rounds)
    reference = run_float_qdq(qat, checks)
    runtime = ort.InferenceSession(str(qat), providers=["CPUExecutionProvider"]).run(None, checks)[0]
    return {"latency": latency, "sizes": {k: p.stat().st_size for k, p in paths.items()},
            "float_ops": recal["qoperator"].float_ops, "recal_diff": recal["qoperator"].verification.max_abs_diff,
            "ort_diff": float(np.abs(runtime - reference).max()), "range": float(reference.max() - reference.min())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3 rounds, 64x64 inputs")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    args = parser.parse_args()
    rounds, size = (3, 64) if args.quick else (args.rounds, args.size)
    torch.set_num_threads(1)
    print(f"batch 1, 1 thread, {size}x{size}, median of {rounds} interleaved rounds (ms); sizes in KB; "
          "fidelity: max |logit difference| from the QAT export run as float QDQ, 64 inputs")
    print("| model | fp32 | recal qoperator | recal qdq | ort static | speed-up vs fp32 | vs static | size fp32 / "
          "recal / static | float ops left (qoperator) | recal max diff | ort int8 max diff |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models:
            r = bench(name, size, rounds, Path(tmp) / name)
            ms = {k: v * 1e3 for k, v in r["latency"].items()}
            kb = {k: v / 1024 for k, v in r["sizes"].items()}
            left = ", ".join(f"{op} x{n}" for op, n in r["float_ops"].items()) or "none"
            print(f"| {name} | {ms['fp32']:.2f} | {ms['recal qoperator']:.2f} | {ms['recal qdq']:.2f} | "
                  f"{ms['ort quantize_static']:.2f} | {ms['fp32'] / ms['recal qoperator']:.2f}x | "
                  f"{ms['ort quantize_static'] / ms['recal qoperator']:.2f}x | {kb['fp32']:.0f} / "
                  f"{kb['recal qoperator']:.0f} / {kb['ort quantize_static']:.0f} | {left} | "
                  f"{r['recal_diff']:.4g} | {r['ort_diff']:.4g} (range {r['range']:.3g}) |", flush=True)


if __name__ == "__main__":
    main()
