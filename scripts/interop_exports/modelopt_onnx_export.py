"""NVIDIA ModelOpt's ONNX-side quantization (its PTQ path for TensorRT and onnxruntime, run on an fp32 ONNX file),
into tests/fixtures/interop/:

- ``modelopt-int4-awq-bert.onnx``: INT4 weight-only (``quantize_mode="int4"``, ``calibration_method="awq_clip"``, its
  path for LLMs): opset-21 ``DequantizeLinear`` of int4 weights in blocks of 128 along K before each MatMul. At its
  defaults it quantizes the pooler's and classifier's ``Gemm`` (transB=1, weights [N, K]) too, with scales in blocks
  along K but the ``DequantizeLinear``'s axis 0: a file onnxruntime does not run, which the converter refuses by node
  with the axis that fits (``refused/modelopt-int4-awq-bert-gemm.onnx``). With ``nodes_to_exclude=[".*Gemm$"]`` (its
  int4 mode reads no ``op_types_to_exclude``) the file runs and converts.
- ``modelopt-onnx-int8-bert.onnx`` and ``modelopt-onnx-int8-resnet.onnx``: INT8 (``quantize_mode="int8"``, its
  default entropy calibration): int8 QDQ on the inputs of MatMuls and convs, attention products included, not on the
  layers too small for it (the classifiers) nor on a residual add.
- ``modelopt-onnx-int8-fp16-bert.onnx`` and ``modelopt-onnx-int8-fp16-resnet.onnx``: the same at its default
  ``high_precision_dtype="fp16"``: every float constant and scale in float16 (opset 19), Casts at the float32 inputs and
  outputs.

The small BERT and ResNet of ``common.py`` are trained, exported to fp32 ONNX (TorchScript path, batch 1) and
quantized on real text windows / the calibration batches, computing in fp32 on the CPU. ModelOpt's ONNX side needs no
GPU; installed beside this project's ``.venv`` (its pins of onnx and onnxruntime-gpu are for its GPU paths, not
needed here):

    .venv/bin/pip install --no-deps --target /tmp/mo_site nvidia-modelopt onnx-graphsurgeon nvidia-ml-py omegaconf \\
        antlr4-python3-runtime==4.9.3 pulp onnxslim polygraphy onnxconverter-common cppimport lief
    PYTHONPATH=/tmp/mo_site .venv/bin/python scripts/interop_exports/modelopt_onnx_export.py
"""

import tempfile
from pathlib import Path

import numpy as np
from modelopt.onnx.quantization import quantize

from common import FIXTURES, fp32_for_onnx_quantizers

with tempfile.TemporaryDirectory() as folder:
    fp32 = fp32_for_onnx_quantizers(Path(folder))  # only the quantizer's inputs
    # ModelOpt takes its calibration samples stacked: 64 steps of batch 1
    stacked = {name: {key: np.concatenate([f[key] for f in feeds]) for key in feeds[0]}
               for name, (_, feeds) in fp32.items()}
    (FIXTURES / "refused").mkdir(exist_ok=True)
    runs = [("bert", "int4", {"calibration_method": "awq_clip"},
             FIXTURES / "refused" / "modelopt-int4-awq-bert-gemm.onnx"),
            ("bert", "int4", {"calibration_method": "awq_clip", "nodes_to_exclude": [".*Gemm$"]},
             FIXTURES / "modelopt-int4-awq-bert.onnx"),
            ("bert", "int8", {}, FIXTURES / "modelopt-onnx-int8-bert.onnx"),
            ("resnet", "int8", {}, FIXTURES / "modelopt-onnx-int8-resnet.onnx"),
            ("bert", "int8", {"high_precision_dtype": "fp16"}, FIXTURES / "modelopt-onnx-int8-fp16-bert.onnx"),
            ("resnet", "int8", {"high_precision_dtype": "fp16"}, FIXTURES / "modelopt-onnx-int8-fp16-resnet.onnx")]
    for model, mode, options, out in runs:
        quantize(str(fp32[model][0]), quantize_mode=mode, calibration_data=stacked[model], calibration_eps=["cpu"],
                 output_path=str(out), log_level="WARNING", **{"high_precision_dtype": "fp32", **options})
        print("wrote", out)
