"""Real pretrained models quantized by peer tools' ONNX post-training quantizers, at their documented defaults, on the
same 16 rendered calibration inputs as ``quantize_static`` (:func:`rapidocr_quantize.calibration_for`, seed 1):

- ``nncf``: NNCF's ``nncf.quantize(onnx_model, nncf.Dataset(...))`` (int8 QDQ, per-channel weights, its mixed preset);
- ``modelopt``: NVIDIA ModelOpt's ``modelopt.onnx.quantization.quantize(quantize_mode="int8")`` (entropy calibration,
  fp32 kept: ``high_precision_dtype="fp32"``, as these models compute on the CPU).

Each runs beside this project's ``.venv`` from its own site folder (their pins are not ours):

    .venv/bin/pip install --no-deps --target /tmp/nncf_site nncf openvino-telemetry pydot networkx tabulate
    PYTHONPATH=/tmp/nncf_site .venv/bin/python scripts/real_models/peer_quantize.py nncf MODEL.onnx OUT.onnx
    PYTHONPATH=/tmp/mo_site .venv/bin/python scripts/real_models/peer_quantize.py modelopt MODEL.onnx OUT.onnx

(the ModelOpt site as ``scripts/interop_exports/modelopt_onnx_export.py`` installs it).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np
import onnx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from rapidocr_quantize import calibration_for

TOOLS = ("nncf", "modelopt")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("tool", choices=TOOLS)
    parser.add_argument("model", type=Path)
    parser.add_argument("output", type=Path)
    args = parser.parse_args(argv)
    calibration = calibration_for(args.model)
    model = onnx.load(str(args.model))
    name = model.graph.input[0].name
    if args.tool == "nncf":
        import nncf

        quantized = nncf.quantize(model, nncf.Dataset([{name: calibration[i:i + 1]} for i in range(16)]),
                                  subset_size=16)
        onnx.save(quantized, str(args.output))
    else:
        from modelopt.onnx.quantization import quantize

        with tempfile.TemporaryDirectory() as folder:  # ModelOpt reads a file and takes its samples stacked
            source = Path(folder) / "fp32.onnx"
            onnx.save(model, str(source))
            quantize(str(source), quantize_mode="int8", calibration_data={name: np.ascontiguousarray(calibration)},
                     calibration_eps=["cpu"], high_precision_dtype="fp32", output_path=str(args.output))
    print("wrote", args.output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
