"""Real pretrained models, quantized as a user would and converted: speed against the QDQ file in a default
onnxruntime session, fidelity against fp32 on realistic inputs, and verification's own figures.

The models are RapidOCR's (PaddleOCR weights exported by paddle2onnx, shipped in the ``rapidocr_onnxruntime`` wheel,
Apache-2.0): the text-direction classifier, committed as ``tests/fixtures/real/`` with the script that made it
(``scripts/real_models/rapidocr_quantize.py``), and, given the unpacked wheel's folder, the text recognizer, quantized
here the same way (``quantize_static``: QDQ, per channel, uint8 activations, int8 weights, 16 rendered calibration
lines, no pre-processing). Inputs: lines of the Python standard library's source rendered in DejaVu fonts (upright or
upside down); fidelity is the top-1 agreement with the fp32 model (per image for the classifier, per position for
the recognizer), for the QDQ file in a default session and for recal's model.

    python scripts/bench_real_models.py [--wheel /tmp/w/rapidocr_onnxruntime/models] [--repeats 3]
        [--json docs/results/real_models.json]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import warnings
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))
from bench.results import machine, report  # noqa: E402
from bench.timing import interleaved_latency, repeated, spread  # noqa: E402
from real_models.rapidocr_quantize import quantize_rendered, text_lines  # noqa: E402
from recal_onnx import VerificationError, quantize_qat_export  # noqa: E402
from recal_onnx.verify import session  # noqa: E402

FIXTURES = ROOT / "tests" / "fixtures" / "real"
SAMPLES = 32  # rendered lines each model is judged on


def _agreement(path: Path, fp32: Path, x: np.ndarray) -> float:
    """Top-1 agreement with the fp32 model over the last axis (a class, or a position's character)."""
    got_session, want_session = session(str(path)), session(str(fp32))
    name = got_session.get_inputs()[0].name
    got = np.concatenate([got_session.run(None, {name: x[i:i + 1]})[0] for i in range(len(x))])
    want = np.concatenate([want_session.run(None, {name: x[i:i + 1]})[0] for i in range(len(x))])
    return float(np.mean(got.argmax(-1) == want.argmax(-1)))


def row(label: str, fp32: Path, qdq: Path, folder: Path, repeats: int) -> dict:
    x, _ = text_lines(SAMPLES, seed=2)
    name = session(str(qdq)).get_inputs()[0].name
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            result = quantize_qat_export(str(qdq), folder / f"{label}.int8.onnx", inputs={name: x})
    except VerificationError as exc:  # a refusal is a row too: what was refused and why
        return {"model": label, "refused": " ".join(str(exc).split())[:400],
                "agreement": {"QDQ file": _agreement(qdq, fp32, x)}}
    paths = {"fp32": fp32, "QDQ file": qdq, "recal": result.path}
    runs = repeated(lambda: {"all": interleaved_latency(paths, {name: x[:1]}, rounds=7, min_seconds=0.05)},
                    repeats)
    latency = {k: statistics.median(run["all"][k] for run in runs) for k in paths}
    ratios = [run["all"]["QDQ file"] / run["all"]["recal"] for run in runs]
    outputs = result.verification.outputs
    runtime = outputs[0].runtime if outputs else None
    return {"model": label, "latency": latency, "x_qdq": ratios, "sizes": {k: p.stat().st_size for k, p in
                                                                          paths.items()},
            "agreement": {k: _agreement(p, fp32, x) for k, p in paths.items() if k != "fp32"},
            "verified": str(result.verification), "typical": outputs[0].typical if outputs else None,
            "runtime_typical": runtime.typical if runtime is not None else None,
            "float_ops": result.float_ops}


def table(data: dict) -> str:
    lines = ["| model | fp32 ms | QDQ file ms | recal ms | recal vs QDQ file | top-1 vs fp32: QDQ file / recal | "
             "size fp32 / recal (kB) |", "|---" * 7 + "|"]
    for r in data["rows"]:
        if "refused" in r:
            lines.append(f"| {r['model']} | refused by verification: {r['refused'][:160]}... | | | | "
                         f"{r['agreement']['QDQ file']:.3f} / - | |")
            continue
        ms, low_mid_high = r["latency"], spread(r["x_qdq"])
        lines.append(f"| {r['model']} | {ms['fp32']:.2f} | {ms['QDQ file']:.2f} | {ms['recal']:.2f} | "
                     f"{low_mid_high[1]:.2f}x ({low_mid_high[0]:.2f}-{low_mid_high[2]:.2f}) | "
                     f"{r['agreement']['QDQ file']:.3f} / {r['agreement']['recal']:.3f} | "
                     f"{r['sizes']['fp32'] / 1000:.0f} / {r['sizes']['recal'] / 1000:.0f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--wheel", type=Path, help="the unpacked rapidocr_onnxruntime wheel's models/ folder")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        rows.append(row("RapidOCR text-direction classifier", FIXTURES / "rapidocr-cls-fp32.onnx",
                        FIXTURES / "rapidocr-cls-quantize-static.onnx", folder, args.repeats))
        recognizer = args.wheel / "ch_PP-OCRv4_rec_infer.onnx" if args.wheel else None
        if recognizer is not None and recognizer.is_file():
            rows.append(row("RapidOCR text recognizer (PP-OCRv4)", recognizer,
                            quantize_rendered(recognizer, folder / "rec.qdq.onnx"), folder, args.repeats))
    data = {**machine(), "samples": SAMPLES, "repeats": args.repeats, "rows": rows}
    return report(data, table(data), args.json)


if __name__ == "__main__":
    sys.exit(main())
