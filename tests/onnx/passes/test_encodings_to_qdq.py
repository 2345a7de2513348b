"""``encodings_to_qdq`` on tiny graphs: its rewrites, the op types after, the numbers in onnxruntime."""

import numpy as np
import onnx

from recal_onnx.aimet_encodings import load_encodings
from recal_onnx.findings import Findings
from recal_onnx.passes.encodings_to_qdq import encodings_to_qdq
from tests.onnx.passes.graphs import _apply
from tests.support.onnx_graphs import Builder, ops, reference


def test_encodings_to_qdq_quantizes_what_aimets_encodings_name():
    """AIMET's encodings on a float Gemm: its input at 4 bits (a QuantizeLinear, a Clip to 0..15, a DequantizeLinear;
    zero point ``-offset``), its weight per output channel (int8, zero point ``-offset - 128``), its bias at 32 bits
    (int32 multiples of its scale), its output (the graph output, keeping its name). The values are AIMET's:
    ``(clamp(round(x / s) - offset, 0, 2**bits - 1) + offset) * s``."""
    b = Builder()
    rng = np.random.default_rng(0)
    w, bias = b.const(rng.standard_normal((3, 4)).astype(np.float32), "w"), b.const(np.float32([0.1, -0.2, 0.3]), "b")
    y = b.node("Gemm", ["x", w, bias], transB=1)
    model = b.model([("x", [2, 4])], [y])
    entry = {"bw": 8, "dtype": "INT", "enc_type": "PER_TENSOR"}
    encodings = load_encodings({"version": "1.0.0", "activation_encodings": [
        {**entry, "name": "x", "bw": 4, "offset": [-3], "scale": [0.25]}, {**entry, "name": y, "offset": [-128],
                                                                           "scale": [0.05]}],
        "param_encodings": [{**entry, "name": w, "enc_type": "PER_CHANNEL", "offset": [-128] * 3,
                             "scale": [0.01, 0.02, 0.03]},
                            {**entry, "name": bias, "bw": 32, "offset": [-(2 ** 31)], "scale": [0.0025]}]})
    findings = Findings()
    converted, (n,) = _apply(model, lambda g, findings: encodings_to_qdq(g, findings, encodings), findings=findings)
    kinds = ops(converted)
    assert n == 4 and kinds.count("QuantizeLinear") == 2 and kinds.count("Clip") == 1, kinds
    assert [o.name for o in converted.graph.output] == [y]
    values = {t.name: onnx.numpy_helper.to_array(t) for t in converted.graph.initializer}
    assert sorted(str(values[n.input[0]].dtype) for n in converted.graph.node
                  if n.op_type == "DequantizeLinear" and n.input[0] in values) == ["int32", "int8"]
    x = np.linspace(-2, 5, 8, dtype=np.float32).reshape(2, 4)

    def aimet(v, s, offset, bits):  # the grid's integers exactly (float64 holds 32 bits); x / s in float32
        q = np.clip(np.round(np.float32(v) / np.float32(s)).astype(np.float64) - offset, 0, 2 ** bits - 1)
        return ((q + offset) * np.float32(s)).astype(np.float32)

    wq = aimet(onnx.numpy_helper.to_array(next(t for t in model.graph.initializer if t.name == w)),
               np.float32([[0.01], [0.02], [0.03]]), -128, 8)
    want = aimet(aimet(x, 0.25, -3, 4) @ wq.T + aimet(np.float32([0.1, -0.2, 0.3]), 0.0025, -(2 ** 31), 32),
                 0.05, -128, 8)
    np.testing.assert_allclose(reference(converted, {"x": x})[0], want, atol=1e-6)
