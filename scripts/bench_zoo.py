"""The CNN zoo on onnxruntime: fp32 vs recal's int8 (``qoperator`` with int8 or uint8 weights, ``qdq``) vs
onnxruntime's ``quantize_static``.

The models of ``tests/zoo/test_cnns.py`` (Hugging Face ResNet, MobileNetV2, EfficientNet, ConvNeXt from small
configs; torchvision-style ResNet / MobileNetV2 / Inception blocks) and two full-width ones, ResNet-18
(``scripts/zoo.py``) and Hugging Face's default ResNet-50; random weights, nothing downloaded. Each is pruned 80% and
QAT-trained for a few steps on synthetic 32x32 data, exported at ``--size`` (QDQ) and converted by
``quantize_qat_export`` (``weight_type`` int8, uint8, and this CPU's choice for ``qdq``); the float model (same
seed, not trained) is exported and quantized by onnxruntime's ``quantize_static`` (QDQ, uint8 activations,
int8 per-channel weights, after ``quant_pre_process``, calibrated on 8 synthetic inputs).

One table: median latency at batch 1, 1 thread (every model in turn, round after round, each run for 20 ms a
round), the speed-up of
recal's model for this CPU (``weight_type="auto"``: int8 weights with VNNI / AMX, uint8 without) over fp32 and
over ``quantize_static``, sizes, the float ops left in recal's ``qoperator`` model (by design or not) and
fidelity: the largest difference of the logits from the QAT export run as float QDQ (optimizations off) on
64 inputs, as a share of the logits' range, and argmax agreement, for recal's int8 and for onnxruntime's own
int8 execution of that same QDQ export. Run it on an idle machine: it measures latency.

    python scripts/bench_zoo.py [--quick] [--rounds 15] [--size 224] [--models resnet18 hf-resnet-basic ...]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import warnings
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))
from bench_transformers import ort_quantized  # noqa: E402
from speed import interleaved_latency  # noqa: E402
from recal_onnx import cpu, quantize_qat_export  # noqa: E402
from recal_onnx.verify import reference_session, session  # noqa: E402
from recal_torch import export_onnx  # noqa: E402
from tests.zoo.test_cnns import CLASSES, HF, MODELS, prune_and_qat  # noqa: E402
from zoo import ResNet18  # noqa: E402


def hf_resnet50() -> torch.nn.Module:
    import transformers

    return HF(transformers.ResNetForImageClassification(transformers.ResNetConfig(num_labels=CLASSES)))


BUILDERS = {"resnet18": lambda: ResNet18(CLASSES), "hf-resnet50": hf_resnet50, **{name: m[0] for name, m in MODELS.items()}}
RECAL = {"recal int8 w": ("qoperator", "int8"), "recal uint8 w": ("qoperator", "uint8"), "recal qdq": ("qdq", "auto")}


def bench(name: str, size: int, rounds: int, folder: Path) -> dict:
    folder.mkdir()
    sample = torch.randn(1, 3, size, size)
    torch.manual_seed(0)
    fp32 = export_onnx(BUILDERS[name]().eval(), sample, folder / "fp32.onnx", dynamo=False)
    qat = export_onnx(prune_and_qat(name, BUILDERS[name]), sample, folder / "qat.onnx", dynamo=False)
    rng = np.random.default_rng(0)
    checks = {"input": rng.standard_normal((64, 3, size, size)).astype(np.float32)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        recal = {label: quantize_qat_export(str(qat), folder / f"{label}.onnx", format=fmt, weight_type=weights,
                                            verify_inputs=checks, tolerance=float("inf"))
                 for label, (fmt, weights) in RECAL.items()}
    calibration = [{"input": rng.standard_normal((1, 3, size, size)).astype(np.float32)} for _ in range(8)]
    static = ort_quantized(fp32, folder, calibration, dynamic=False)["ort quantize_static"][0]
    paths = {"fp32": fp32, **{label: folder / f"{label}.onnx" for label in RECAL}, "ort quantize_static": static}
    latency = interleaved_latency(paths, {"input": sample.numpy()}, rounds, per_round=1, min_seconds=0.02)
    reference = reference_session(str(qat)).run(None, checks)[0]
    runtime = session(str(qat)).run(None, checks)[0]  # onnxruntime's own int8 execution (default level)
    here = "recal " + recal["recal qdq"].weight_type + " w"  # this CPU's exact choice
    v = recal[here].verification  # int8 weights on a CPU that saturates them: measured through the uint8 twin
    span = float(reference.max() - reference.min())
    return {"latency": latency, "here": here, "sizes": {k: p.stat().st_size for k, p in paths.items()},
            "float_ops": recal[here].float_ops, "recal_diff": v.max_abs_diff / span,
            "recal_agree": v.argmax_agreement, "ort_diff": float(np.abs(runtime - reference).max()) / span,
            "ort_agree": float(np.mean(runtime.argmax(1) == reference.argmax(1)))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3 rounds, 64x64 inputs, the small models")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--models", nargs="+", choices=list(BUILDERS))
    args = parser.parse_args()
    rounds, size = (3, 64) if args.quick else (args.rounds, args.size)
    models = args.models or list(MODELS if args.quick else BUILDERS)
    torch.set_num_threads(1)
    print(f"{cpu.describe()}\nbatch 1, 1 thread, {size}x{size}, median of {rounds} interleaved rounds (ms); "
          "'recal' = its model for this CPU (int8 weights with VNNI / AMX, uint8 without); sizes in KB; fidelity: "
          "max |logit difference| from the QAT export run as float QDQ, % of the logits' range, and argmax "
          "agreement, 64 inputs")
    print("| model | fp32 | recal int8 w | recal uint8 w | recal qdq | ort static | recal vs fp32 | recal vs static | "
          "size fp32 / recal / static | float ops left | recal max diff, agreement | ort int8 max diff, agreement |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for name in models:
            r = bench(name, size, rounds, Path(tmp) / name)
            ms = r["latency"]
            kb = {k: v / 1024 for k, v in r["sizes"].items()}
            here, static = ms[r["here"]], ms["ort quantize_static"]
            left = ", ".join(f"{op} x{n}" for op, n in r["float_ops"].items()) or "none"
            print(f"| {name} | {ms['fp32']:.2f} | {ms['recal int8 w']:.2f} | {ms['recal uint8 w']:.2f} | "
                  f"{ms['recal qdq']:.2f} | {static:.2f} | {ms['fp32'] / here:.2f}x | {static / here:.2f}x | "
                  f"{kb['fp32']:.0f} / {kb[r['here']]:.0f} / {kb['ort quantize_static']:.0f} | {left} | "
                  f"{100 * r['recal_diff']:.2f}%, {r['recal_agree']:.3f} | {100 * r['ort_diff']:.2f}%, "
                  f"{r['ort_agree']:.3f} |", flush=True)


if __name__ == "__main__":
    main()
