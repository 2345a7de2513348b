"""Real pretrained models, quantized as a user would and converted: speed against the QDQ file in a default
onnxruntime session, fidelity against fp32 on realistic inputs, and verification's own figures.

The models are RapidOCR's (PaddleOCR weights exported by paddle2onnx, shipped in the ``rapidocr_onnxruntime`` wheel,
Apache-2.0): the text-direction classifier, committed as ``tests/fixtures/real/`` with the script that made it
(``scripts/real_models/rapidocr_quantize.py``), and, given the unpacked wheel's folder, the text recognizer, quantized
here the same way (``quantize_static``: QDQ, per channel, uint8 activations, int8 weights, 16 rendered calibration
lines, no pre-processing), and the text detector (DBNet) the same way on 16 rendered pages. Inputs: lines of the
Python standard library's source rendered in DejaVu fonts (upright or upside down), or 320 x 320 pages of them;
fidelity is the task's agreement with the fp32 model (top-1 per image for the classifier, per position for the
recognizer; the detector's text-probability map thresholded at 0.5, per pixel), for the QDQ file in a default session
and for recal's model.

    python scripts/bench_real_models.py [--wheel /tmp/w/rapidocr_onnxruntime/models] [--repeats 3]
        [--peer nncf /tmp/nncf_site] [--peer modelopt /tmp/mo_site] [--json docs/results/real_models.json]

With ``--peer``, each model is also quantized by that peer's ONNX quantizer at its defaults
(``scripts/real_models/peer_quantize.py``, run from the peer's own site folder) and converted the same way.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

import numpy as np

from bench.results import machine, report
from bench.timing import interleaved_latency, repeated, spread
from real_models.rapidocr_quantize import quantize_rendered, rendered_inputs
from recal_onnx import VerificationError, quantize_qat_export
from recal_onnx import task_hits
from recal_onnx import session

ROOT = Path(__file__).resolve().parent.parent


FIXTURES = ROOT / "tests" / "fixtures" / "real"
SAMPLES = 32  # rendered lines each model is judged on
DETECTOR_SAMPLES = 16  # rendered pages (320 x 320) the detector is judged on
PEERS = {"nncf": "NNCF", "modelopt": "ModelOpt"}


def _agreement(path: Path, fp32: Path, x: np.ndarray) -> float:
    """The task's agreement with the fp32 model, as verification reads it (:func:`recal_onnx.output_diff.task_hits`):
    top-1 over the last axis (a class, or a position's character), or the detector's probability map at 0.5."""
    got_session, want_session = session(str(path)), session(str(fp32))
    name = got_session.get_inputs()[0].name
    got = np.concatenate([got_session.run(None, {name: x[i:i + 1]})[0] for i in range(len(x))])
    want = np.concatenate([want_session.run(None, {name: x[i:i + 1]})[0] for i in range(len(x))])
    return float(np.mean(task_hits(want, got)))


def judged_on(fp32: Path) -> np.ndarray:
    """The held-out inputs (seed 2): pages for the detector, lines for the others."""
    return rendered_inputs(fp32, DETECTOR_SAMPLES if "det" in fp32.name else SAMPLES, seed=2)


def row(label: str, fp32: Path, qdq: Path, folder: Path, repeats: int) -> dict:
    x = judged_on(fp32)
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
    lines = ["| model | fp32 ms | QDQ file ms | recal ms | recal vs QDQ file | task vs fp32: QDQ file / recal | "
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
    parser.add_argument("--peer", nargs=2, action="append", default=[], metavar=("TOOL", "SITE"),
                        help="also quantize with a peer (nncf or modelopt) installed in SITE "
                             "(scripts/real_models/peer_quantize.py)")
    args = parser.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        rows.append(row("RapidOCR text-direction classifier", FIXTURES / "rapidocr-cls-fp32.onnx",
                        FIXTURES / "rapidocr-cls-quantize-static.onnx", folder, args.repeats))
        recognizer = args.wheel / "ch_PP-OCRv4_rec_infer.onnx" if args.wheel else None
        detector = args.wheel / "ch_PP-OCRv4_det_infer.onnx" if args.wheel else None
        if recognizer is not None and recognizer.is_file():
            rows.append(row("RapidOCR text recognizer (PP-OCRv4)", recognizer,
                            quantize_rendered(recognizer, folder / "rec.qdq.onnx"), folder, args.repeats))
        if detector is not None and detector.is_file():
            rows.append(row("RapidOCR text detector (PP-OCRv4, DBNet)", detector,
                            quantize_rendered(detector, folder / "det.qdq.onnx"), folder, args.repeats))
        for tool, site in args.peer:  # the same models through a peer's ONNX quantizer, run from its own site
            for label, fp32 in (("RapidOCR text-direction classifier", FIXTURES / "rapidocr-cls-fp32.onnx"),
                                ("RapidOCR text recognizer (PP-OCRv4)", recognizer),
                                ("RapidOCR text detector (PP-OCRv4, DBNet)", detector)):
                if fp32 is None or not fp32.is_file():
                    continue
                qdq = folder / f"{tool}-{fp32.stem}.onnx"
                subprocess.run([sys.executable, str(ROOT / "scripts" / "real_models" / "peer_quantize.py"), tool,
                                str(fp32), str(qdq)], check=True, env={**os.environ, "PYTHONPATH": site},
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                rows.append(row(f"{label}, {PEERS[tool]}", fp32, qdq, folder, args.repeats))
    data = {**machine(), "samples": SAMPLES, "detector_samples": DETECTOR_SAMPLES, "repeats": args.repeats, "rows": rows}
    return report(data, table(data), args.json)


if __name__ == "__main__":
    sys.exit(main())
