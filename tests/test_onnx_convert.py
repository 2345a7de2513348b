"""quantize_qat_export end to end: recal_torch exports (both exporters), torch.ao eager QAT exports,
residual adds, int8 zero points, errors, atomic writes, the CLI."""

import hashlib
import subprocess
import sys
import warnings

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from torch import nn

from recal_onnx import UnconvertedOpsWarning, VerificationError, quantize_qat_export
from recal_torch import ScheduledModifierManager, export_onnx

from .conftest import ROOT
from .onnx_graphs import Builder, ops, with_float_biases
from .torch_models import SmallCNN, batches, train_steps

QAT = """
- !EpochRangeModifier {start_epoch: 0, end_epoch: 3}
- !GradualKSModifier {params: __ALL_PRUNABLE__, init_sparsity: 0.3, final_sparsity: 0.6, start_epoch: 0,
                      end_epoch: 1, update_frequency: 0.5}
- !QuantizationModifier {start_epoch: 1, freeze_bn_stats_epoch: 2}
"""


@pytest.fixture(scope="module")
def recal_qat_model():
    torch.manual_seed(0)
    model = SmallCNN()
    manager = ScheduledModifierManager.from_yaml(QAT)
    optimizer = manager.modify(model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), steps_per_epoch=4)
    train_steps(model, optimizer, batches(12))
    manager.finalize(model)
    return model.eval()


def _agreement(path, model, n=1000):
    x = torch.randn(n, 1, 8, 8, generator=torch.Generator().manual_seed(5))
    session = ort.InferenceSession(str(path))  # default options: what users get
    got = session.run(None, {session.get_inputs()[0].name: x.numpy()})[0]
    with torch.no_grad():
        ref = model(x).numpy()
    return float((got.argmax(1) == ref.argmax(1)).mean()), float(np.abs(got - ref).max())


@pytest.mark.parametrize("dynamo", [True, False])
@pytest.mark.parametrize("fmt", ["qoperator", "qdq"])
def test_recal_torch_exports_convert(recal_qat_model, tmp_path, dynamo, fmt):
    src = export_onnx(recal_qat_model, torch.randn(1, 1, 8, 8), tmp_path / "qat.onnx", dynamo=dynamo)
    digest = hashlib.sha256(src.read_bytes()).hexdigest()
    result = quantize_qat_export(src, tmp_path / "int8.onnx", format=fmt)
    assert hashlib.sha256(src.read_bytes()).hexdigest() == digest  # the input is never modified
    names = ops(onnx.load(str(result.path)))
    if fmt == "qoperator":
        assert names.count("QLinearConv") == 3 and "Conv" not in names and "QGemm" in names
    else:
        assert "Conv" in names and "QLinearConv" not in names
    assert "BatchNormalization" not in names
    agreement, max_diff = _agreement(result.path, recal_qat_model)
    print(f"dynamo={dynamo} {fmt}: agreement {agreement:.4f}, max abs diff {max_diff:.4f}, {result.verification}")
    assert agreement >= 0.995
    int8_bytes = sum(t.ByteSize() for t in onnx.load(str(result.path)).graph.initializer)
    float_bytes = sum(p.numel() * 4 for p in SmallCNN().parameters())
    assert int8_bytes < 0.6 * float_bytes  # tiny model: scales and biases weigh in; the benchmark measures size
    assert sorted(p.name for p in tmp_path.iterdir()) == ["int8.onnx", "qat.onnx"]


def _weight_dtypes(model):
    """Integer weight dtypes of the QLinearConv / QGemm nodes."""
    inits = {t.name: t.data_type for t in model.graph.initializer}
    return {onnx.helper.tensor_dtype_to_np_dtype(inits[n.input[3]]).name for n in model.graph.node
            if n.op_type in ("QLinearConv", "QGemm")}


@pytest.mark.parametrize("weight_type, exact_here, expected", [
    ("int8", False, {"int8"}), ("uint8", True, {"uint8"}), ("auto", True, {"int8"}),
    ("auto", False, {"uint8"})])
def test_weight_type(recal_qat_model, tmp_path, monkeypatch, weight_type, exact_here, expected):
    """int8 weights (VNNI / AMX / Arm), uint8 beyond +-64 (x86 without VNNI), or auto: by this CPU. An int8 model
    converted on a CPU that saturates it is verified through its uint8 twin and written with int8 weights."""
    import recal_onnx.convert as convert
    import recal_onnx.passes.uint8_weights as uint8_pass

    src = export_onnx(recal_qat_model, torch.randn(1, 1, 8, 8), tmp_path / "qat.onnx", dynamo=False)
    verify = not exact_here or convert.int8_weights_exact_here()  # int8 weights run as written only where exact
    monkeypatch.setattr(convert, "int8_weights_exact_here", lambda: exact_here)
    monkeypatch.setattr(uint8_pass, "int8_weights_exact_here", lambda: exact_here)
    result = quantize_qat_export(src, tmp_path / "int8.onnx", weight_type=weight_type, verify=verify)
    assert result.weight_type == ("int8" if expected == {"int8"} else "uint8")
    assert _weight_dtypes(onnx.load(str(result.path))) == expected  # per-channel int8 weights reach +-127
    if verify:  # op by op within a step (saturating int8 kernels are off by many): the uint8 twin ran here
        assert result.verification.local_steps <= 1
    with pytest.raises(ValueError, match="weight_type must be one of"):
        quantize_qat_export(src, weight_type="int4")


def _ao_model(activation_dtype=torch.quint8):
    import torch.ao.quantization as tq

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.quant, self.dequant = tq.QuantStub(), tq.DeQuantStub()
            self.conv1, self.bn1, self.relu1 = nn.Conv2d(1, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU()
            self.conv2, self.bn2 = nn.Conv2d(8, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8)
            self.add = nn.quantized.FloatFunctional()
            self.relu2, self.pool = nn.ReLU(), nn.MaxPool2d(2)
            self.gap, self.fc = nn.AdaptiveAvgPool2d(1), nn.Linear(8, 10)

        def forward(self, x):
            x = self.quant(x)
            y = self.relu1(self.bn1(self.conv1(x)))
            y = self.relu2(self.add.add(self.bn2(self.conv2(y)), y))
            y = torch.flatten(self.gap(self.pool(y)), 1)
            return self.dequant(self.fc(y))

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.manual_seed(0)
        model = Net().train()
        low, high = (0, 255) if activation_dtype == torch.quint8 else (-128, 127)
        model.qconfig = tq.QConfig(
            activation=tq.FakeQuantize.with_args(observer=tq.MovingAverageMinMaxObserver, quant_min=low,
                                                 quant_max=high, dtype=activation_dtype),
            weight=tq.FakeQuantize.with_args(observer=tq.MovingAveragePerChannelMinMaxObserver, quant_min=-128,
                                             quant_max=127, dtype=torch.qint8, qscheme=torch.per_channel_symmetric))
        tq.fuse_modules_qat(model, [["conv1", "bn1", "relu1"], ["conv2", "bn2"]], inplace=True)
        tq.prepare_qat(model, inplace=True)
        train_steps(model, torch.optim.SGD(model.parameters(), lr=0.05), batches(10))
        model.apply(tq.disable_observer)
        model.apply(torch.ao.nn.intrinsic.qat.freeze_bn_stats)
    return model.eval()


@pytest.mark.parametrize("activation_dtype", [torch.quint8, torch.qint8])
def test_torch_ao_eager_qat_export_converts(tmp_path, activation_dtype):
    model = _ao_model(activation_dtype)
    src = tmp_path / "ao.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(model, (torch.randn(1, 1, 8, 8),), str(src), dynamo=False, opset_version=17,
                          input_names=["input"], output_names=["output"], dynamic_axes={"input": {0: "b"}})
    assert {"Div", "BatchNormalization"} <= set(ops(onnx.load(str(src))))
    # torch.ao puts no QuantizeLinear after the pool: the mean lies between grid points, so the head (pool,
    # flatten, linear) stays float, exact, and named; rounding it to the pool input's grid moved logits by steps
    with pytest.warns(UnconvertedOpsWarning, match="GlobalAveragePool.*Flatten.*Gemm"):
        result = quantize_qat_export(src, tmp_path / "int8.onnx")
    names = ops(result.model)
    assert not {"Div", "BatchNormalization", "Conv", "Add"} & set(names)
    assert {"QLinearConv", "QLinearAdd", "GlobalAveragePool", "Gemm"} <= set(names)
    assert result.verification.local_steps <= 1 and result.verification.local_float < 1e-4
    for init in result.model.graph.initializer:  # activations are uint8 in the output, weights int8
        if init.name.endswith(("_u8",)):
            assert init.data_type == onnx.TensorProto.UINT8
    agreement, _ = _agreement(result.path, model)
    assert agreement >= 0.99


def test_not_a_qat_model(tmp_path):
    path = export_onnx(SmallCNN().eval(), torch.randn(1, 1, 8, 8), tmp_path / "float.onnx", dynamo=False)
    with pytest.raises(ValueError, match="not a QAT model"):
        quantize_qat_export(path, tmp_path / "out.onnx")
    assert not (tmp_path / "out.onnx").exists()


def test_truncated_and_missing_files(tmp_path, recal_qat_model):
    src = export_onnx(recal_qat_model, torch.randn(1, 1, 8, 8), tmp_path / "qat.onnx", dynamo=False)
    bad = tmp_path / "truncated.onnx"
    bad.write_bytes(src.read_bytes()[:200])
    with pytest.raises(ValueError, match="truncated.onnx"):
        quantize_qat_export(bad, tmp_path / "out.onnx")
    with pytest.raises(FileNotFoundError, match="nope.onnx"):
        quantize_qat_export(tmp_path / "nope.onnx")
    with pytest.raises(ValueError, match="refusing to write .*qat.onnx: the input model reads that file"):
        quantize_qat_export(src, src)


def test_verification_failure_writes_nothing(tmp_path, recal_qat_model):
    src = export_onnx(recal_qat_model, torch.randn(1, 1, 8, 8), tmp_path / "qat.onnx", dynamo=False)
    exact = quantize_qat_export(src, tolerance=0.0)  # recal_torch exports: exact, no bias rounded
    assert exact.verification.max_abs_diff == 0 and exact.rounded_biases == {}
    off_grid = with_float_biases(src, tmp_path / "float_biases.onnx")  # biases the int8 model cannot hold
    rounded = quantize_qat_export(off_grid).rounded_biases  # converted at the default check, and reported
    assert len(rounded) == sum(n.op_type in ("QLinearConv", "QGemm") for n in exact.model.graph.node), rounded
    assert all(0 < off <= 0.5 for off in rounded.values())
    with pytest.raises(VerificationError, match="max abs difference .* nothing was written"):
        quantize_qat_export(off_grid, tmp_path / "out.onnx", tolerance=0.0)
    for bad in ({"tolerance": float("nan")}, {"tolerance": -1.0}, {"min_agreement": 1.01}):
        with pytest.raises(ValueError, match="must be a number in"):  # never a check switched off
            quantize_qat_export(src, tmp_path / "out.onnx", **bad)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["float_biases.onnx", "qat.onnx"]


def test_verification_catches_a_wrong_conversion(tmp_path, recal_qat_model, monkeypatch):
    import recal_onnx.passes.conv_to_qlinearconv as conv_pass

    src = export_onnx(recal_qat_model, torch.randn(1, 1, 8, 8), tmp_path / "qat.onnx", dynamo=False)
    real = conv_pass.quantized_bias

    def wrong_bias(g, node, x, w, index):  # a converter bug: biases 8x too large
        bias = real(g, node, x, w, index)
        if bias:
            return g.add_const(bias.name, g.const(bias) * 8)
        return bias

    monkeypatch.setattr(conv_pass, "quantized_bias", wrong_bias)
    with pytest.raises(VerificationError, match="op by op, tensor '.*conv.*' differs by [0-9]+ quantization steps"):
        quantize_qat_export(src, tmp_path / "out.onnx")
    assert not (tmp_path / "out.onnx").exists()


def test_unconverted_ops_are_listed():
    b = Builder()
    y = b.node("Tanh", [b.qdq("x", 0.03, 128)])  # onnxruntime has no quantized tanh
    model = b.model([("x", [2, 4])], [b.qdq(y, 0.008, 128)])
    with pytest.warns(UnconvertedOpsWarning, match="Tanh"):
        result = quantize_qat_export(model)
    assert result.unconverted and result.unconverted[0][0] == "Tanh"


def test_a_chain_of_float_ops_is_listed_whole():
    """DQ -> Sigmoid -> Neg -> Q: neither op both reads a DQ and feeds a Q, and both stay float."""
    b = Builder()
    y = b.node("Neg", [b.node("Sigmoid", [b.qdq("x", 0.03, 128)])])
    model = b.model([("x", [2, 4])], [b.qdq(y, 0.004, 255)])
    with pytest.warns(UnconvertedOpsWarning, match="Sigmoid.*Neg"):
        result = quantize_qat_export(model)
    assert [op for op, _ in result.float_nodes] == ["Sigmoid", "Neg"]


def test_cli_and_script(tmp_path, recal_qat_model):
    src = export_onnx(recal_qat_model, torch.randn(1, 1, 8, 8), tmp_path / "qat.onnx", dynamo=False)
    exe = [sys.executable, "-m", "recal_core.cli", "quantize-qat-export", str(src), str(tmp_path / "a.onnx")]
    out = subprocess.run(exe, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "wrote" in out.stdout and "verified in onnxruntime" in out.stdout
    script = [sys.executable, str(ROOT / "scripts" / "quantize_qat_export.py"), str(src), str(tmp_path / "b.onnx"),
              "--format", "qdq"]
    assert subprocess.run(script, capture_output=True, text=True).returncode == 0
    typed = subprocess.run([*exe[:5], str(tmp_path / "d.onnx"), "--weight-type", "int8"], capture_output=True,
                           text=True)
    assert typed.returncode == 0 and "int8 weights" in typed.stdout, typed.stderr
    bad = subprocess.run([*exe[:4], str(tmp_path / "missing.onnx"), str(tmp_path / "c.onnx")],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "missing.onnx" in bad.stderr and len(bad.stderr.strip().splitlines()) == 1


def test_large_models_use_external_data(tmp_path, recal_qat_model, monkeypatch):
    import recal_onnx.convert as convert

    src = export_onnx(recal_qat_model, torch.randn(1, 1, 8, 8), tmp_path / "qat.onnx", dynamo=False)
    # store the input with external data too, as a > 2 GB export would be
    onnx.save_model(onnx.load(str(src)), str(tmp_path / "big.onnx"), save_as_external_data=True,
                    all_tensors_to_one_file=True, location="big.onnx.data", size_threshold=0)
    monkeypatch.setattr(convert, "EXTERNAL_DATA_BYTES", 1)  # pretend the output is above the limit
    monkeypatch.setattr(convert, "EXTERNAL_TENSOR_BYTES", 0)
    result = quantize_qat_export(tmp_path / "big.onnx", tmp_path / "out.onnx")
    assert (tmp_path / "out.onnx.data").is_file()
    session = ort.InferenceSession(str(result.path))
    assert session.run(None, {"input": np.zeros((2, 1, 8, 8), np.float32)})[0].shape == (2, 10)


def test_generated_inputs_cover_the_table_an_integer_input_indexes():
    from onnx import TensorProto, helper, numpy_helper

    from recal_onnx.verify import generated_inputs

    table = numpy_helper.from_array(np.arange(1000 * 4, dtype=np.int8).reshape(1000, 4), "table")
    scale = numpy_helper.from_array(np.float32(0.1), "s")
    nodes = [helper.make_node("DequantizeLinear", ["table", "s"], ["t"]),
             helper.make_node("Cast", ["ids"], ["ids32"], to=TensorProto.INT32),
             helper.make_node("Gather", ["t", "ids32"], ["e"]),
             helper.make_node("Cast", ["attention_mask"], ["m"], to=TensorProto.FLOAT),
             helper.make_node("Mul", ["e", "m"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("ids", TensorProto.INT64, ["b", 16]),
                                           helper.make_tensor_value_info("attention_mask", TensorProto.INT64,
                                                                         ["b", 16]),
                                           helper.make_tensor_value_info("flags", TensorProto.INT64, [4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], [table, scale])
    feeds = generated_inputs(helper.make_model(graph))
    assert feeds["ids"].shape == (256, 16) and feeds["ids"].min() >= 0 and feeds["ids"].max() < 1000
    assert len(np.unique(feeds["ids"])) > 900  # the vocabulary, not {0, 1}
    assert (feeds["attention_mask"] == 1).all()
    assert set(np.unique(feeds["flags"])) <= {0, 1}


def _pooled_head(requantized: bool):
    """A ReLU'd feature map, global average pool, linear head with float logits; ``requantized``: the pool's
    output rounded to the pool's *input* grid, as a converter that invents a QuantizeLinear after it does."""
    b = Builder(seed=4)
    pooled = b.node("GlobalAveragePool", [b.qdq("x", 0.05, 0)])
    if requantized:
        pooled = b.qdq(pooled, 0.05, 0)
    logits = b.node("Gemm", [b.node("Flatten", [pooled]), b.weight((10, 16)),
                             b.const(np.linspace(-0.5, 0.5, 10, dtype=np.float32))], transB=1)
    model = b.model([("x", [64, 16, 6, 6])], [logits])
    model.graph.output[0].CopyFrom(onnx.helper.make_tensor_value_info(logits, onnx.TensorProto.FLOAT, [64, 10]))
    return model


def test_verification_fails_an_invented_grid_that_the_old_tolerance_passed():
    """The converted model's values are compared op by op: every integer tensor of both, and float outputs
    from the QAT model's own integer inputs. An average pool re-quantized at its input's scale (a grid the QAT
    model never had) fails it, though end to end it stays within the old 10%-of-range tolerance."""
    from recal_onnx import verify_models

    feeds = {"x": np.abs(np.random.default_rng(0).standard_normal((64, 16, 6, 6))).astype(np.float32) * 2}
    v = verify_models(_pooled_head(False), _pooled_head(True), feeds)
    assert v.max_abs_diff <= 0.1 * v.output_range  # what the old default accepted
    assert "op by op, a float output differs" in v.problem(None)
    result = quantize_qat_export(_pooled_head(False), inputs=feeds)  # the exact conversion passes
    assert result.verification.local_float < 1e-4 and result.verification.local_steps <= 1


@pytest.mark.parametrize("fmt", ["qoperator", "qdq"])
def test_a_bias_beyond_int32_leaves_its_layer_float_and_says_why(fmt):
    """A bias that int32 cannot hold in steps of input scale x weight scale (a near-dead input) is never clipped:
    the layer stays float and the warning names it and the reason."""
    b = Builder()
    y = b.node("Conv", [b.qdq("x", 1e-6, 0), b.weight((4, 3, 3, 3)), b.const(np.full(4, 50.0, np.float32))],
               pads=[1, 1, 1, 1])
    y = b.qdq(y, 0.5, 0)
    model = b.model([("x", [2, 3, 6, 6])], [y])
    model.graph.output[0].CopyFrom(onnx.helper.make_tensor_value_info(y, onnx.TensorProto.FLOAT, [2, 4, 6, 6]))
    with pytest.warns(UnconvertedOpsWarning, match="Conv '.*' \\(its bias is beyond int32"):
        result = quantize_qat_export(model, format=fmt, inputs={"x": np.full((2, 3, 6, 6), 1e-5, np.float32)})
    assert "QLinearConv" not in ops(result.model) and result.float_nodes[0][0] == "Conv"
    assert result.verification.max_abs_diff == 0


def test_verification_runs_in_chunks_with_the_same_result(recal_qat_model, tmp_path, monkeypatch):
    """256 generated 224x224 images in one run took 4.5 GB for a ResNet-50: onnxruntime sees 16 samples at a
    time, and the comparison is the same as in one run."""
    import recal_onnx.verify as verify

    src = export_onnx(recal_qat_model, torch.randn(1, 1, 8, 8), tmp_path / "qat.onnx", dynamo=False)
    feeds = {"input": np.random.default_rng(1).standard_normal((40, 1, 8, 8)).astype(np.float32)}
    batches = []

    class Counted:  # an onnxruntime session that notes the batch of every run
        def __init__(self, runner):
            self.runner = runner

        def run(self, names, given):
            batches.append(len(given["input"]))
            return self.runner.run(names, given)

    real = verify._run_in_chunks
    monkeypatch.setattr(verify, "_run_in_chunks", lambda runner, f, batched: real(Counted(runner), f, batched))
    chunked = quantize_qat_export(src, inputs=feeds).verification
    assert batches == [16, 16, 8] * 2  # the QAT model, then the converted one
    monkeypatch.setattr(verify, "CHUNK", 1000)
    whole = quantize_qat_export(src, inputs=feeds).verification
    assert batches[6:] == [40, 40]
    assert (chunked.max_abs_diff, chunked.argmax_agreement, chunked.samples) == \
           (whole.max_abs_diff, whole.argmax_agreement, whole.samples) and chunked.samples == 40
