"""The tiny graphs and exports the interoperability tests share."""

import collections
import warnings
from pathlib import Path

import numpy as np
import onnx
import torch

from recal_onnx.verify import generated_inputs
from tests.support.onnx_graphs import QONNX_DOMAIN, Builder, qonnx_model, qonnx_quant, run

X_SCALE, OUT_SCALE = 0.03, 0.02


def _int32_bias(b, w_scale, n, per_channel, grid=1.0, dtype=np.int32):
    """``DequantizeLinear(int32, s_x * s_w * grid)``: a bias as quantize_static, Brevitas and AIMET write it
    (``dtype`` int8: as AMD Quark's XINT8 does, on a coarser power-of-two grid)."""
    scale = (np.float32(X_SCALE) * np.asarray(w_scale, np.float32) * np.float32(grid)).astype(np.float32)
    q = b.rng.integers(-3000, 3000, n).astype(np.int32) if dtype == np.int32 else b.rng.integers(-100, 100, n, dtype)
    return b.node("DequantizeLinear", [b.const(q, "bq"), b.const(scale if per_channel else scale.reshape(-1)[0], "bs")],
                  **({"axis": 0} if per_channel else {}))


def _weight_scale(b, w):
    producer = next(n for n in b.nodes if n.output[0] == w)
    return onnx.numpy_helper.to_array(next(t for t in b.inits if t.name == producer.input[1]))


def _layer(op, per_channel, grid=1.0, batch=2, bias_dtype=np.int32):
    b = Builder()
    if op == "Conv":
        x = b.qdq("x", X_SCALE, 128)
        w = b.weight((4, 3, 3, 3), per_channel=per_channel)
        y = b.node("Conv", [x, w, _int32_bias(b, _weight_scale(b, w), 4, per_channel, grid, bias_dtype)],
                   pads=[1, 1, 1, 1])
        shape = [batch, 3, 6, 6]
    else:
        x = b.qdq("x", X_SCALE, 128)
        w = b.weight((8, 4), axis=1, per_channel=per_channel)
        bias = _int32_bias(b, _weight_scale(b, w), 4, per_channel, grid, bias_dtype)
        y = b.node("Gemm", [x, w, bias]) if op == "Gemm" else b.node("Add", [b.node("MatMul", [x, w]), bias])
        shape = [batch, 8]
    model = b.model([("x", shape)], [b.qdq(y, OUT_SCALE, 128)])
    out = model.graph.output[0].type.tensor_type.shape  # as exporters declare it (onnxruntime's contrib QGemm has
    out.dim.extend(onnx.TensorShapeProto.Dimension(dim_value=d) for d in shape[:1] + [4])  # no shape inference)
    if op == "Conv":
        out.dim.extend(onnx.TensorShapeProto.Dimension(dim_value=d) for d in (6, 6))
    return model, shape


def _uint8_weight_conv(zero_point, low, high):
    b = Builder()
    x = b.qdq("x", X_SCALE, 128)
    q = b.rng.integers(low, high + 1, (4, 3, 3, 3)).astype(np.uint8)
    w = b.node("DequantizeLinear", [b.const(q, "w"), b.const(np.float32(0.01), "ws"),
                                    b.const(np.uint8(zero_point), "wz")])
    return b.model([("x", [2, 3, 6, 6])], [b.qdq(b.node("Conv", [x, w], pads=[1, 1, 1, 1]), OUT_SCALE, 128)])


class SmallNet(torch.nn.Module):
    """Two convs (one grouped) with a residual add, a pool and a classifier."""

    def __init__(self):
        super().__init__()
        self.conv1, self.conv2 = torch.nn.Conv2d(3, 16, 3, padding=1), torch.nn.Conv2d(16, 16, 3, padding=1, groups=4)
        self.fc = torch.nn.Linear(16, 10)

    def forward(self, x):
        y = torch.relu(self.conv1(x))
        y = torch.relu(self.conv2(y)) + y
        return self.fc(torch.flatten(torch.nn.functional.adaptive_avg_pool2d(y, 1), 1))


def _export_small_net(path) -> None:
    """:class:`SmallNet` (seed 0) by torch.onnx's TorchScript path, batch fixed at 1, into ``path``."""
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(SmallNet().eval(), torch.randn(1, 3, 8, 8), path, dynamo=False, input_names=["input"])


def _optimized_ops(path, tmp_path, level=None):
    """The op types (with their domain) of ``path`` as an onnxruntime session runs it (its default level unless
    ``level`` says)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    if level is not None:
        options.graph_optimization_level = level
    options.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    options.log_severity_level = 3  # its note that the saved graph holds this CPU's layouts
    ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    return collections.Counter(f"{n.domain}:{n.op_type}" for n in onnx.load(tmp_path / "optimized.onnx").graph.node)


def _quantize_static(fp32, out, feeds, **options):
    """onnxruntime's ``quantize_static`` (QDQ unless ``quant_format`` says) of ``fp32`` calibrated on ``feeds``,
    warnings silenced."""
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, quantize_static

    class Reader(CalibrationDataReader):
        def __init__(self):
            self.items = iter(feeds)

        def get_next(self):
            return next(self.items, None)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        quantize_static(str(fp32), str(out), Reader(), **{"quant_format": QuantFormat.QDQ, **options})


def _tiny_bert(tmp_path):
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    model = BertForSequenceClassification(BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                                     intermediate_size=64, vocab_size=200,
                                                     max_position_embeddings=32)).eval()
    for name, p in model.named_parameters():  # trained-like biases (torch's export shares equal ones)
        if name.endswith("bias"):
            torch.nn.init.normal_(p, std=0.02)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(model, (torch.randint(0, 200, (1, 16)),), tmp_path / "bert.onnx", dynamo=False,
                          input_names=["input_ids"], output_names=["logits"],
                          dynamic_axes={"input_ids": {0: "batch", 1: "sequence"}})
    return tmp_path / "bert.onnx"


FIXTURE_DIR = Path(__file__).parents[1] / "fixtures" / "interop"


READ_FIRST = ("qonnx", "sim")  # QONNX, AIMET's float model with encodings: tested by their own tests below


FIXTURES = sorted(p for p in FIXTURE_DIR.glob("*-small-resnet.onnx") if not any(k in p.stem for k in READ_FIRST))


TRANSFORMER_FIXTURES = sorted(p for p in FIXTURE_DIR.glob("*-small-bert.onnx")
                              if not any(k in p.stem for k in READ_FIRST))


def _runtime_float_layers(path, tmp_path):
    """The Conv / Gemm / MatMul onnxruntime's own QDQ fusion (extended level) leaves float in ``path``."""
    import onnxruntime as ort

    kinds = _optimized_ops(path, tmp_path, ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED)
    return sum(n for key, n in kinds.items() if key.split(":")[1] in ("Conv", "Gemm", "MatMul", "FusedConv"))


def _reaches(model, name, ops, moves=("Transpose", "Reshape", "Cast", "Identity")):
    """Whether ``name`` is made by one of ``ops`` (through ``moves``); an initializer counts as "constant"."""
    made = {o: n for n in model.graph.node for o in n.output}
    node = made.get(name)
    while node is not None and node.op_type not in ops and node.op_type in moves:
        name = node.input[0]
        node = made.get(name)
    if node is None:
        return "constant" in ops and name in {t.name for t in model.graph.initializer}
    return node.op_type in ops


def _float_weight_layers(model):
    """The MatMul / Gemm nodes reading a constant weight in float (through Q / Clip / DQ, Transpose, Reshape, Cast)."""
    moves = ("QuantizeLinear", "Clip", "DequantizeLinear", "Transpose", "Reshape", "Cast", "Identity")
    return [n.name for n in model.graph.node
            if n.op_type in ("MatMul", "Gemm") and _reaches(model, n.input[1], ("constant", "Constant"), moves)]


def _same_with_and_without_optimizations(model):
    """The converted model gives the same outputs in a default onnxruntime session and with optimizations off."""
    import onnxruntime as ort

    feeds = generated_inputs(model, 1, seed=3)
    for got, want in zip(run(model, feeds), run(model, feeds, level=ort.GraphOptimizationLevel.ORT_DISABLE_ALL)):
        np.testing.assert_array_equal(got, want)


def ort_session(model):
    import onnxruntime as ort

    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


def _qonnx_layer(**overrides):
    """x -> Quant -> Conv(Quant(w)) -> Quant: a QONNX model with one quantizer's inputs or attributes as given."""
    b = Builder()
    rng = np.random.default_rng(0)
    spec = {"scale": 0.05, "zero_point": 0, "bits": 8, "signed": 1, "narrow": 0, **overrides}
    scale = b.const(np.asarray(spec["scale"], np.float32)) if not isinstance(spec["scale"], str) else spec["scale"]
    attrs = {k: spec[k] for k in ("signed", "narrow", "rounding_mode") if k in spec and spec[k] is not None}
    x = b.node("Quant", ["x", scale, b.const(np.asarray(spec["zero_point"], np.float32)),
                         b.const(np.float32(spec["bits"]))], domain=QONNX_DOMAIN, **attrs)
    w = qonnx_quant(b, b.const(rng.standard_normal((4, 3, 3, 3)).astype(np.float32) * 0.3), 0.01, 0, 8, narrow=1)
    y = qonnx_quant(b, b.node("Conv", [x, w], pads=[1, 1, 1, 1]), 0.0937, 0, 8)  # no tie at every 200th
    inputs = [("x", [2, 3, 6, 6])] + ([("s", [])] if isinstance(spec["scale"], str) else [])
    return qonnx_model(b, inputs, [(y, [2, 4, 6, 6])])
