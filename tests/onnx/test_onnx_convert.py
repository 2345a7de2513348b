"""quantize_qat_export end to end: recal_torch exports (both exporters), torch.ao eager QAT exports,
residual adds, int8 zero points, errors, atomic writes, the CLI."""

import hashlib
import subprocess
import sys

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from recal_onnx import UnconvertedOpsWarning, quantize_qat_export
from recal_torch import ScheduledModifierManager, export_onnx

from tests.support.cli_in_process import run_recal
from tests.support.paths import ROOT
from tests.support.onnx_graphs import Builder, ops
from tests.support.torch_models import SmallCNN, batches, train_steps

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
    # 8-bit weights: beside the int8 model, its twin for x86 without VNNI (target any)
    assert result.avx2_path == tmp_path / "int8.x86-avx2.onnx" and "int8.x86-avx2.onnx" in result.weights_note
    assert sorted(p.name for p in tmp_path.iterdir()) == ["int8.onnx", "int8.x86-avx2.onnx", "qat.onnx"]
    assert any(t.data_type == onnx.TensorProto.UINT8 and "_u8" in t.name  # weights shifted to uint8
               for t in onnx.load(str(result.avx2_path)).graph.initializer)


def _weight_dtypes(model):
    """Integer weight dtypes of the QLinearConv / QGemm nodes."""
    inits = {t.name: t.data_type for t in model.graph.initializer}
    return {onnx.helper.tensor_dtype_to_np_dtype(inits[n.input[3]]).name for n in model.graph.node
            if n.op_type in ("QLinearConv", "QGemm")}


@pytest.mark.parametrize("target, weight_type, expected", [
    ("any", "auto", {"int8"}), ("x86-avx2", "auto", {"uint8"}), ("x86-vnni", "auto", {"int8"}),
    ("arm64", "auto", {"int8"}), ("x86-vnni", "uint8", {"uint8"}), ("any", "int8", {"int8"})])
def test_the_target_decides_the_weights_not_the_converting_cpu(recal_qat_model, tmp_path, monkeypatch, target,
                                                               weight_type, expected):
    """8-bit QAT weights reach +-127: int8 for targets that compute them exactly (VNNI / AMX / Arm), uint8 beyond +-64
    for x86 without VNNI, both files for the default ``any``; the same files on a CPU with or without VNNI.
    Verification runs what the target computes (on a CPU without VNNI, the default's twin)."""
    import recal_onnx.cpu as cpu
    import recal_onnx.passes.uint8_weights as uint8_pass
    import recal_onnx.targets as targets

    src = export_onnx(recal_qat_model, torch.randn(1, 1, 8, 8), tmp_path / "qat.onnx", dynamo=False)
    written = {}
    really_exact = cpu.int8_weights_exact_here()  # int8 weights run as written only where exact
    for exact_here in (False, True):
        for module in (cpu, uint8_pass, targets):
            monkeypatch.setattr(module, "int8_weights_exact_here", lambda: exact_here)
        out = tmp_path / f"int8-{exact_here}.onnx"
        result = quantize_qat_export(src, out, weight_type=weight_type, target=target,
                                     verify=really_exact or not exact_here)
        assert result.target == target and result.weight_type == ("int8" if expected == {"int8"} else "uint8")
        assert _weight_dtypes(onnx.load(str(out))) == expected
        assert ("uint8" in result.weights_note) == (expected == {"uint8"} or result.avx2_path is not None)
        twin = target == "any" and weight_type == "auto"
        assert (result.avx2_path is not None) == twin, result.weights_note
        if twin:  # which file for which CPU, in the result and in each file
            assert "VNNI or AMX" in result.weights_note and out.with_name(out.stem + ".x86-avx2.onnx").is_file()
            assert _weight_dtypes(onnx.load(str(result.avx2_path))) == {"uint8"}
            assert "without VNNI" in onnx.load(str(result.avx2_path)).metadata_props[-1].value
            assert ("this CPU's kind" in result.weights_note) == (not exact_here)
        written[exact_here] = out.read_bytes() + (result.avx2_path.read_bytes() if twin else b"")
    assert written[False] == written[True]  # nothing about the files depends on the converting CPU
    with pytest.raises(ValueError, match="weight_type must be one of"):
        quantize_qat_export(src, weight_type="int4")
    with pytest.raises(ValueError, match="target must be one of"):
        quantize_qat_export(src, target="x86")


def test_native_target_says_which_cpu_it_resolved_to(recal_qat_model, tmp_path, monkeypatch):
    import recal_onnx.targets as targets

    src = export_onnx(recal_qat_model, torch.randn(1, 1, 8, 8), tmp_path / "qat.onnx", dynamo=False)
    for exact_here, resolved in ((True, "x86-vnni"), (False, "x86-avx2")):
        monkeypatch.setattr(targets, "int8_weights_exact_here", lambda: exact_here)
        result = quantize_qat_export(src, target="native", verify=False)
        assert result.target == resolved and "native" in result.weights_note


@pytest.fixture(scope="module")
def reduce_range_model():
    torch.manual_seed(0)
    model = SmallCNN()
    manager = ScheduledModifierManager.from_yaml(QAT.replace("freeze_bn_stats_epoch: 2", "freeze_bn_stats_epoch: 2, "
                                                                                         "reduce_range: true"))
    optimizer = manager.modify(model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), steps_per_epoch=4)
    train_steps(model, optimizer, batches(12))
    manager.finalize(model)
    assert all("7-bit" in what for what in manager.quantized_layers.values() if "table" not in what)
    return model.eval()


def _integer_weights(model):
    """The int8 initializers of a model (its quantized weights)."""
    return [onnx.numpy_helper.to_array(t) for t in model.graph.initializer if t.data_type == onnx.TensorProto.INT8]


@pytest.mark.parametrize("dynamo", [True, False])
def test_reduce_range_qat_is_int8_and_exact_on_every_target(reduce_range_model, tmp_path, dynamo):
    """7-bit QAT weights (reduce_range) reach +-64 and no further, in the QAT export and the int8 model: the QAT
    export runs the same in a default onnxruntime session (integer kernels) as with optimizations off, and the
    int8 model is the same file for every target, int8 throughout, verified here as written."""
    src = export_onnx(reduce_range_model, torch.randn(1, 1, 8, 8), tmp_path / "qat.onnx", dynamo=dynamo)
    weights = _integer_weights(onnx.load(str(src)))
    if dynamo:  # the dynamo export stores int8 weights; TorchScript's stores them float behind a Q
        assert max(int(np.abs(w.astype(np.int16)).max()) for w in weights) == 64
    x = torch.randn(256, 1, 8, 8, generator=torch.Generator().manual_seed(3)).numpy()
    plain = ort.SessionOptions()
    plain.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    outs = [s.run(None, {s.get_inputs()[0].name: x})[0]
            for s in (ort.InferenceSession(str(src)), ort.InferenceSession(str(src), plain))]
    step = float(np.ptp(outs[1])) / 255
    assert (outs[0].argmax(1) == outs[1].argmax(1)).mean() >= 0.99 and np.abs(outs[0] - outs[1]).max() <= 2 * step
    files = set()
    for target in ("any", "x86-avx2", "x86-vnni", "arm64"):
        result = quantize_qat_export(src, tmp_path / f"{target}.onnx", target=target)
        assert _weight_dtypes(result.model) == {"int8"} and "within +-64" in result.weights_note
        assert max(int(np.abs(w.astype(np.int16)).max()) for w in _integer_weights(result.model)) <= 64
        assert result.verification.local_steps <= 1
        files.add((tmp_path / f"{target}.onnx").read_bytes())
    assert len(files) == 1


def test_cli_and_script(tmp_path, recal_qat_model):
    src = export_onnx(recal_qat_model, torch.randn(1, 1, 8, 8), tmp_path / "qat.onnx", dynamo=False)
    exe = [sys.executable, "-m", "recal_app.cli", "quantize-qat-export", str(src), str(tmp_path / "a.onnx")]
    out = subprocess.run(exe, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "wrote" in out.stdout and "verified in onnxruntime" in out.stdout
    script = [sys.executable, str(ROOT / "scripts" / "quantize_qat_export.py"), str(src), str(tmp_path / "b.onnx"),
              "--format", "qdq"]
    assert subprocess.run(script, capture_output=True, text=True).returncode == 0
    # the options, in this process (the command as a process is tested above)
    typed = run_recal(*exe[3:5], str(tmp_path / "d.onnx"), "--weight-type", "int8")
    assert typed.returncode == 0 and "int8 weights" in typed.stdout, typed.stderr
    bad = run_recal(exe[3], str(tmp_path / "missing.onnx"), str(tmp_path / "c.onnx"))
    assert bad.returncode == 2 and "missing.onnx" in bad.stderr and len(bad.stderr.strip().splitlines()) == 1


def test_large_models_use_external_data(tmp_path, recal_qat_model, monkeypatch):
    src = export_onnx(recal_qat_model, torch.randn(1, 1, 8, 8), tmp_path / "qat.onnx", dynamo=False)
    # store the input with external data too, as a > 2 GB export would be
    onnx.save_model(onnx.load(str(src)), str(tmp_path / "big.onnx"), save_as_external_data=True,
                    all_tensors_to_one_file=True, location="big.onnx.data", size_threshold=0)
    from recal_onnx import save

    monkeypatch.setattr(save, "EXTERNAL_DATA_BYTES", 1)  # pretend the output is above the limit
    monkeypatch.setattr(save, "EXTERNAL_TENSOR_BYTES", 0)
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


def test_verification_streams_in_bounded_chunks_with_the_same_result(recal_qat_model, tmp_path, monkeypatch):
    """Both models see the same samples a chunk at a time (the first sample alone, to measure what one costs,
    then as many as fit verify.MEMORY, at most 16), nothing of the outputs is kept but running figures, and the
    comparison is that of one run: a language model's logits over a large vocabulary cannot fill memory."""
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

    real = verify._paired_chunks
    monkeypatch.setattr(verify, "_paired_chunks",
                        lambda runners, f, batched, *a: real([Counted(r) for r in runners], f, batched, *a))
    chunked = quantize_qat_export(src, inputs=feeds).verification
    # the QAT model as written, the converted one, and onnxruntime's default session of the QAT model, chunk by chunk
    assert batches == [1, 1, 1, 16, 16, 16, 16, 16, 16, 7, 7, 7]
    batches.clear()
    monkeypatch.setattr(verify, "MEMORY", 3 * 2 * 10 * 4)  # two samples of the three runs' [1, 10] float logits
    small = quantize_qat_export(src, inputs=feeds).verification
    assert batches[:3] == [1, 1, 1] and max(batches) == 2 and sum(batches) == 120
    batches.clear()
    monkeypatch.setattr(verify, "MEMORY", 2**40)
    monkeypatch.setattr(verify, "CHUNK", 1000)
    whole = quantize_qat_export(src, inputs=feeds).verification
    assert batches == [1, 1, 1, 39, 39, 39]
    for result in (chunked, small):
        assert (result.max_abs_diff, result.argmax_agreement, result.samples, result.median_abs_diff,
                result.outputs) == (whole.max_abs_diff, whole.argmax_agreement, whole.samples, whole.median_abs_diff,
                                    whole.outputs) and result.samples == 40


def test_sparsity_follows_float_weights_through_quantize_and_dequantize():
    """tf2onnx writes a TF QAT model's weights as float -> QuantizeLinear -> DequantizeLinear: its sparsity is the
    float weight's; a model with no weight at all has an unknown sparsity, not 0."""
    from onnx import TensorProto, helper, numpy_helper

    from recal_app.training import overall_sparsity
    from recal_app.onnx_artefacts import weight_sparsity

    w = np.zeros((4, 3), np.float32)
    w[0] = 1.0  # 75% zero
    nodes = [helper.make_node("QuantizeLinear", ["w", "s", "zp"], ["wq"]),
             helper.make_node("DequantizeLinear", ["wq", "s", "zp"], ["wd"]),
             helper.make_node("MatMul", ["x", "wd"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 3])],
                              [numpy_helper.from_array(w.T.copy().T, "w"), numpy_helper.from_array(np.float32(0.1), "s"),
                               numpy_helper.from_array(np.int8(0), "zp")])
    layers = weight_sparsity(helper.make_model(graph))
    assert layers == {"w": 0.75}
    assert overall_sparsity({}, {}) is None


@pytest.mark.parametrize("dtype", [np.int16, np.uint16])
def test_a_model_whose_every_activation_is_16_bit_is_refused_at_the_start(tmp_path, dtype):
    """Int16 / uint16 activations have no QLinear kernel: a model with no 8-bit activation would convert nothing, so
    one error says so, naming the type and the first node, before any work, and nothing is written. (Among 8-bit
    ones, a 16-bit tensor leaves only its layers float: tests/onnx/test_onnxruntime_exports.py.)"""
    from recal_onnx import ModelError

    b = Builder()
    y = b.node("Relu", [b.qdq("x", 0.01, 0, dtype=dtype)])
    model = b.model([("x", [1, 4])], [y])
    with pytest.raises(ModelError, match=rf"every activation is quantized to 16 bits \({np.dtype(dtype).name}, first "
                                         r"at QuantizeLinear .*re-export with 8-bit activations"):
        quantize_qat_export(model, tmp_path / "out.onnx")
    assert not list(tmp_path.iterdir())


def test_a_4_bit_activation_is_refused_at_the_start(tmp_path):
    """A 4-bit activation (opset 21) has no integer kernel at all: one error naming the node, the tensor and the
    type, before any work."""
    from recal_onnx import ModelError

    b = Builder()
    s, z = b.const(np.float32(0.1)), "z4"
    b.inits.append(onnx.helper.make_tensor("z4", onnx.TensorProto.INT4, [], [0]))
    y = b.node("DequantizeLinear", [b.node("QuantizeLinear", ["x", s, z]), s, z])
    model = b.model([("x", [1, 4])], [b.node("Relu", [y])])
    model.opset_import[0].version = 21
    with pytest.raises(ModelError, match=r"quantizes tensor 'x' to int4; the converter writes"):
        quantize_qat_export(model, tmp_path / "out.onnx")
    assert not list(tmp_path.iterdir())


def test_float_ops_of_a_qdq_model_leave_out_what_onnxruntime_runs_in_int8(recal_qat_model, tmp_path):
    """In ``format="qdq"`` a Conv or Gemm between DequantizeLinear inputs and a QuantizeLinear is an integer
    kernel in onnxruntime: ``float_ops`` counts what computes in float, so it lists neither (qoperator agrees)."""
    src = export_onnx(recal_qat_model, torch.randn(1, 1, 8, 8), tmp_path / "qat.onnx", dynamo=False)
    qdq = quantize_qat_export(src, format="qdq")
    qop = quantize_qat_export(src)
    assert "Conv" in [n.op_type for n in qdq.model.graph.node]
    assert not {"Conv", "Gemm", "MatMul"} & set(qdq.float_ops), qdq.float_ops
    assert set(qdq.float_ops) == set(qop.float_ops), (qdq.float_ops, qop.float_ops)
