"""Run under ``qemu-x86_64 -cpu Haswell`` by ``tests/onnx/test_avx2_emulated.py``: onnxruntime then dispatches its AVX2
kernels (no VNNI), whose uint8 x int8 pair sums saturate. Converts models there and prints one JSON line of what it
found; the test asserts on it. Kept small: everything here runs emulated, about 20x slower than natively.

``python tests/support/avx2_emulated_run.py OUT_FOLDER`` (natively it reports the VNNI answers, which the test also uses).
"""

from __future__ import annotations

import json
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

ROOT = Path(__file__).resolve().parents[2]

from recal_onnx import VerificationError, cpu, quantize_qat_export  # noqa: E402
from recal_onnx.verify import verify_models  # noqa: E402
from recal_onnx.verify_inputs import generated_inputs  # noqa: E402

FIXTURES = ROOT / "tests" / "fixtures" / "interop"
SAMPLES = 8  # verification samples a model: enough to see saturation, few enough to run emulated
MODELS = {  # what each stands for in the suite
    "twin of an 8-bit model": "nncf-small-resnet.onnx",
    "zoo CNN": "tfmot-mobilenetv2.onnx",
    "transformer": "nncf-small-bert.onnx",
    "int4 MatMulNBits": "modelopt-int4-awq-bert.onnx",
}


def saturating_conv() -> onnx.ModelProto:
    """DQ(x) -> Conv(DQ(w: 64 input channels of int8 127)) -> Q -> DQ: every output sums 64 products of up to 255 x
    127, beyond what two 16-bit pair sums hold."""
    weight = np.full((2, 64, 1, 1), 127, np.int8)
    weight[1] = -127
    inits = [numpy_helper.from_array(v, n) for n, v in (
        ("xs", np.float32(0.02)), ("xz", np.uint8(0)), ("w", weight), ("ws", np.float32(0.01)), ("wz", np.int8(0)),
        ("ys", np.float32(4.0)), ("yz", np.uint8(128)))]
    nodes = [helper.make_node("QuantizeLinear", ["x", "xs", "xz"], ["xq"]),
             helper.make_node("DequantizeLinear", ["xq", "xs", "xz"], ["xd"]),
             helper.make_node("DequantizeLinear", ["w", "ws", "wz"], ["wd"]),
             helper.make_node("Conv", ["xd", "wd"], ["c"], name="conv"),
             helper.make_node("QuantizeLinear", ["c", "ys", "yz"], ["yq"]),
             helper.make_node("DequantizeLinear", ["yq", "ys", "yz"], ["y"])]
    graph = helper.make_graph(nodes, "saturating", [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                                                                   ["N", 64, 2, 2])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])


def _weight_types(path: Path) -> list[str]:
    model = onnx.load(str(path))
    found = {i.name: i.data_type for i in model.graph.initializer}
    return sorted({TensorProto.DataType.Name(found[n.input[3]]) for n in model.graph.node
                   if n.op_type == "QLinearConv" and n.input[3] in found})


def _converted(source, out: Path, inputs: dict, **options) -> dict:
    """One conversion here: its verification's figures, or the refusal's first words."""
    started = time.perf_counter()
    try:
        result = quantize_qat_export(source, out, inputs=inputs, **options)
    except VerificationError as exc:
        return {"verified": False, "why": str(exc)[:300], "seconds": time.perf_counter() - started}
    return {"verified": True, "seconds": time.perf_counter() - started, "target": result.target,
            "twin": result.avx2_path is not None, "ran": str(result.verification)[:200]}


def main(out: Path) -> dict:
    warnings.simplefilter("ignore")
    found = {"probe_exact": cpu.probed_int8_exact(), "describe": cpu.describe(), "models": {}}
    tiny = saturating_conv()
    feeds = {"x": np.random.default_rng(0).uniform(0, 5.1, (SAMPLES, 64, 2, 2)).astype(np.float32)}
    native = _converted(tiny, out / "tiny-native.onnx", feeds, target="native")
    found["tiny native"] = {**native, "weights": _weight_types(out / "tiny-native.onnx")}
    quantize_qat_export(tiny, out / "tiny-int8.onnx", target="x86-vnni", verify=False)
    int8 = verify_models(tiny, onnx.load(str(out / "tiny-int8.onnx")), feeds, runtime=False)
    found["tiny int8"] = {"max_steps": int8.max_abs_diff / 4.0, "weights": _weight_types(out / "tiny-int8.onnx")}
    for role, name in MODELS.items():
        source = FIXTURES / name
        inputs = generated_inputs(onnx.load(str(source)), batch=SAMPLES)
        entry = _converted(source, out / name, inputs)
        if entry.get("twin"):  # the pair's int8 file, run here too (where kernels saturate, it is refused)
            check = verify_models(str(source), onnx.load(str(out / name)), inputs, runtime=False)
            entry["int8 file"] = {"problem": check.problem(None), "max_abs_diff": check.max_abs_diff,
                                  "clean_op_by_op": check.clean_op_by_op}
        found["models"][role] = {"file": name, **entry}
    return found


if __name__ == "__main__":
    folder = Path(sys.argv[1])
    folder.mkdir(parents=True, exist_ok=True)
    print(json.dumps(main(folder)))
