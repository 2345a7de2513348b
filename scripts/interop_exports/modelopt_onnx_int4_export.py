"""NVIDIA ModelOpt's ONNX INT4 weight-only quantization (AWQ, its documented path for LLMs on onnxruntime and
TensorRT) of a transformer, into tests/fixtures/interop/modelopt-int4-awq-bert.onnx and, as ModelOpt writes it with
its defaults, tests/fixtures/interop/refused/modelopt-int4-awq-bert-gemm.onnx.

The small BERT of ``common.py`` (Hugging Face ``BertForSequenceClassification`` from a config, byte tokens of the
standard library's source) is trained, exported to fp32 ONNX (TorchScript path; token ids of batch 1 and 32
positions) and quantized by ``modelopt.onnx.quantization.quantize(quantize_mode="int4",
calibration_method="awq_clip")`` on text windows, computing in fp32 on the CPU: opset-21 ``DequantizeLinear`` of int4
weights in blocks of 128 along K before each MatMul. At its defaults it quantizes the pooler's and classifier's
``Gemm`` (transB=1, weights [N, K]) too, with scales in blocks along K but the ``DequantizeLinear``'s axis 0: a file
onnxruntime does not run, which the converter refuses by node with the axis that fits. With
``nodes_to_exclude=[".*Gemm$"]`` (its int4 mode reads no ``op_types_to_exclude``) the file runs and converts.
ModelOpt's ONNX side needs no GPU; installed beside this project's ``.venv`` (its pins of onnx and onnxruntime-gpu
are for its GPU paths, not needed here):

    .venv/bin/pip install --no-deps --target /tmp/mo_site nvidia-modelopt onnx-graphsurgeon nvidia-ml-py omegaconf \\
        antlr4-python3-runtime==4.9.3 pulp onnxslim polygraphy onnxconverter-common cppimport lief
    PYTHONPATH=/tmp/mo_site .venv/bin/python scripts/interop_exports/modelopt_onnx_int4_export.py
"""

import tempfile
from pathlib import Path

import numpy as np
import torch
from modelopt.onnx.quantization import quantize

import common
from common import FIXTURES, small_bert, text_accuracy, text_batches, trained_on_text

torch.manual_seed(0)
model = trained_on_text(small_bert())
print("float accuracy", text_accuracy(model))
with tempfile.TemporaryDirectory() as folder:
    common.FIXTURES = Path(folder)  # the fp32 export is only the quantizer's input
    common.export_text_model(model, "fp32.onnx", opset=17)
    windows = torch.cat([ids for ids, _ in text_batches(4, seed=1)])  # 64 windows: 64 calibration steps of batch 1
    (FIXTURES / "refused").mkdir(exist_ok=True)
    for excluded, out in (([], FIXTURES / "refused" / "modelopt-int4-awq-bert-gemm.onnx"),
                          ([".*Gemm$"], FIXTURES / "modelopt-int4-awq-bert.onnx")):
        quantize(str(Path(folder) / "fp32.onnx"), quantize_mode="int4", calibration_method="awq_clip",
                 calibration_data={"input_ids": windows.numpy().astype(np.int64)}, calibration_eps=["cpu"],
                 high_precision_dtype="fp32", nodes_to_exclude=excluded, output_path=str(out), log_level="WARNING")
        print("wrote", out)
