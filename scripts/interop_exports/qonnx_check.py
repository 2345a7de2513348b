"""recal's reading of QONNX (``recal_onnx.passes.qonnx_to_qcdq``, run by ``recal_onnx.read_as_qdq``) against
qonnx's own executor, on the QONNX fixtures Brevitas wrote (``brevitas_export.py``, ``brevitas_bert_export.py``):
every ``Quant`` node's output, as ``qonnx.core.onnx_exec`` computes it, against the same tensor of the QCDQ reading
run in onnxruntime with its optimizations off (float, no fusion).
Prints how many values differ; 0 is the claim. Run in the Brevitas venv with qonnx installed beside it:

    /tmp/venv_brevitas/bin/pip install qonnx
    PYTHONPATH=. /tmp/venv_brevitas/bin/python scripts/interop_exports/qonnx_check.py
"""

import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from qonnx.core.modelwrapper import ModelWrapper
from qonnx.core.onnx_exec import execute_onnx
from qonnx.transformation.infer_shapes import InferShapes

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from recal_onnx import read_as_qdq  # noqa: E402

SAMPLES = 16

for path in sorted((ROOT / "tests" / "fixtures" / "interop").glob("*qonnx*.onnx")):
    theirs = ModelWrapper(str(path)).transform(InferShapes())
    quantized = [n.output[0] for n in theirs.graph.node if n.op_type in ("Quant", "IntQuant")]
    ours = read_as_qdq(path)
    del ours.graph.output[:]
    ours.graph.output.extend(onnx.helper.make_empty_tensor_value_info(name) for name in quantized)
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(ours.SerializeToString(), options, providers=["CPUExecutionProvider"])
    name = theirs.graph.input[0].name
    shape = [d.dim_value for d in theirs.graph.input[0].type.tensor_type.shape.dim]
    rng = np.random.default_rng(0)
    differ = total = 0
    for _ in range(SAMPLES):
        integer = theirs.graph.input[0].type.tensor_type.elem_type == onnx.TensorProto.INT64  # token ids
        x = rng.integers(0, 256, shape) if integer else rng.standard_normal(shape).astype(np.float32)
        got = dict(zip(quantized, session.run(None, {name: x})))
        want = execute_onnx(theirs, {name: x}, return_full_exec_context=True)
        differ += sum(int((got[t] != want[t]).sum()) for t in quantized)
        total += sum(got[t].size for t in quantized)
    print(f"{path.name}: {len(quantized)} Quant outputs, {SAMPLES} samples: {differ} of {total} values differ")
