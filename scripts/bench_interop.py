"""Other tools' QDQ files through ``quantize_qat_export``: what converts, how exactly, and how fast against the QDQ
file the user already has.

Sources, each a QDQ ONNX file as its tool writes it at its documented 8-bit settings:

- onnxruntime's ``quantize_static`` of full-width fp32 models built here (ResNet-18, ``scripts/bench/models.py``; Hugging
  Face's MobileNetV2 from its default config; random weights, nothing downloaded), exported by torch.onnx with its
  default fixed batch of 1, calibrated on 8 synthetic inputs (``peers.quantize_static``: ``quant_pre_process`` first):
  uint8 activations with int8 per-channel weights (onnxruntime's advice for CNNs), and int8 activations with
  per-tensor weights;
- the exports other tools wrote, committed under ``tests/fixtures/interop/`` with the script that made each
  (``scripts/interop_exports/``): every ``*.onnx`` there is a row.

Per file: the layers with a weight that stay float (Conv / Gemm / MatMul), the verification's sample count and its
op-by-op figure (every integer tensor against the QDQ file run as written), and median latency at batch 1 on one
thread, models interleaved round by round, of the QDQ file in a default onnxruntime session (its own QDQ fusion),
recal's default output (int8 weights) and, where written, its twin for x86 without VNNI (uint8 weights beyond
+-64). The CPU is named: which file is fast depends on it.

    python scripts/bench_interop.py [--quick] [--rounds 15] [--json docs/results/interop.json]

``--json`` keeps the runs of other CPUs in that file and replaces this CPU's: docs/interop.md shows each.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import warnings
from pathlib import Path

import numpy as np
import onnx
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))
from bench.peers import quantize_static  # noqa: E402
from bench.results import machine, save_run  # noqa: E402
from bench.timing import interleaved_latency  # noqa: E402
from recal_onnx import cpu, quantize_qat_export  # noqa: E402
from bench.models import ResNet18, torch_init  # noqa: E402

FIXTURES = ROOT / "tests" / "fixtures" / "interop"
WEIGHTED = {"Conv", "Gemm", "MatMul", "ConvTranspose"}


def hf_mobilenet_v2() -> torch.nn.Module:
    """Hugging Face's MobileNetV2 at its default config, with torch's own initialisation: transformers draws its
    BatchNorm scales near 0 and every activation of the random net vanishes (logits spanning 2e-22)."""
    import transformers

    from tests.zoo.test_cnns import HF  # the zoo's logits wrapper

    return torch_init(HF(transformers.MobileNetV2ForImageClassification(transformers.MobileNetV2Config())))


FP32 = {"resnet18": lambda: ResNet18(1000), "hf-mobilenet-v2": hf_mobilenet_v2}
# label -> quantize_static settings: (activation type, per channel)
STATIC = {"ort static u8/s8 per-channel": ("QUInt8", True), "ort static s8/s8 per-tensor": ("QInt8", False)}


def sources(folder: Path, size: int, models: list[str]) -> dict[str, Path]:
    """Every QDQ file to convert, by row label."""
    found = {}
    for name in models:
        torch.manual_seed(0)
        fp32 = folder / f"{name}.fp32.onnx"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.onnx.export(FP32[name]().eval(), torch.randn(1, 3, size, size), fp32, dynamo=False,
                              input_names=["input"])
        rng = np.random.default_rng(0)
        calibration = [{"input": rng.standard_normal((1, 3, size, size)).astype(np.float32)} for _ in range(8)]
        for label, (activation, per_channel) in STATIC.items():
            path = folder / f"{name}.{activation}.{per_channel}.onnx"
            quantize_static(fp32, path, calibration, activation_type=activation, per_channel=per_channel)
            found[f"{label}: {name}"] = path
    for path in sorted(FIXTURES.glob("*.onnx")) if FIXTURES.is_dir() else []:
        found[path.stem] = path
    return found


def float_layers(model: onnx.ModelProto) -> int:
    return sum(n.op_type in WEIGHTED for n in model.graph.node)


def row(label: str, qdq: Path, folder: Path, rounds: int) -> dict:
    out = folder / (label.replace(" ", "_").replace(":", "").replace("/", "-") + ".int8.onnx")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = quantize_qat_export(str(qdq), out)
    model = onnx.load(str(qdq))
    dims = [d.dim_value or 1 for d in model.graph.input[0].type.tensor_type.shape.dim]
    feed = {model.graph.input[0].name: np.random.default_rng(1).standard_normal(dims).astype(np.float32)}
    paths = {"qdq": qdq, "recal": out, **({"recal avx2": result.avx2_path} if result.avx2_path else {})}
    ms = interleaved_latency(paths, feed, rounds, per_round=1, min_seconds=0.02)
    v = result.verification
    return {"source": label, "layers": sum(n.op_type in WEIGHTED for n in model.graph.node),
            "float_layers": float_layers(result.model), "float_reasons": result.float_reasons,
            "samples": v.samples, "local_steps": v.local_steps, "local_share": v.local_share,
            "max_steps": v.max_steps, "agreement": v.argmax_agreement, "latency": ms,
            "weights": result.weights_note}


def table(data: dict) -> str:
    """docs/interop.md's table: every run in ``data`` (one per CPU), each under the CPU it ran on."""
    parts = []
    for run in data["runs"]:
        parts.append(f"{run['cpu']}; batch 1, 1 thread, median of {run['rounds']} interleaved rounds, "
                     f"quantize_static rows at {run['size']}x{run['size']} (`python scripts/bench_interop.py "
                     "--json docs/results/interop.json`)\n\n" + format_rows(run["rows"]))
    return "\n\n".join(parts)


def format_rows(rows: list[dict]) -> str:
    lines = ["| QDQ file | layers | left float | verified on | op by op | argmax agreement | QDQ file (ms) | recal "
             "(ms) | x QDQ file | recal avx2 twin (ms) |", "|---" * 10 + "|"]
    for r in rows:
        ms = r["latency"]
        twin = f"{ms['recal avx2']:.2f}" if "recal avx2" in ms else "none (within +-64)"
        agreement = f"{r['agreement']:.4f}" if r["agreement"] is not None else "-"
        lines.append(f"| {r['source']} | {r['layers']} | {r['float_layers']} | {r['samples']} | "
                     f"<= {r['local_steps']} step(s), {r['local_share']:.1e} differ | {agreement} | {ms['qdq']:.2f} | "
                     f"{ms['recal']:.2f} | {ms['qdq'] / ms['recal']:.2f}x | {twin} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3 rounds, 64x64 inputs")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--models", nargs="+", choices=list(FP32), default=list(FP32))
    parser.add_argument("--json", type=Path, help="also write the rows here (docs/results/interop.json)")
    args = parser.parse_args(argv)
    rounds, size = (3, 64) if args.quick else (args.rounds, args.size)
    torch.set_num_threads(1)
    header = (f"{cpu.describe()}\nbatch 1, 1 thread, median of {rounds} interleaved rounds; quantize_static rows at "
              f"{size}x{size}; recal: quantize_qat_export at its defaults (target any)")
    print(header, flush=True)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for label, path in sources(Path(tmp), size, args.models).items():
            rows.append(row(label, path, Path(tmp), rounds))
            print(format_rows(rows[-1:]).splitlines()[-1], flush=True)
    print(format_rows(rows))
    if args.json:  # one run per CPU: a run on another CPU is kept beside this one
        save_run(args.json, {**machine(), "size": size, "rounds": rounds, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
