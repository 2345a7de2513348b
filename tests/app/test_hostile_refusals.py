"""Hostile files and faults: one clear line for what cannot be taken (converter inputs, zero-size weights, missing
packages, signals, torn checkpoints, FIFOs). Each test here failed before its fix."""

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import onnx
import pytest

from recal_core import RecipeError, load_recipe
from recal_onnx import ModelError, quantize_qat_export
from tests.app.hostile_inputs import DENSE, _cli, _converter_cases, _one_line, _qdq_model
from tests.support.cli_in_process import run_recal
from tests.support.forked import run_program
from tests.support.hang_guard import HANG_SECONDS
from tests.support.paths import ROOT


@pytest.mark.parametrize("opset, domain, words", [
    (9, "", "uses opset 9 of the default ONNX domain; the converter takes opsets 10 to"),
    (99, "", "uses opset 99"),
    (17, "my.company", "ops of custom domains, which onnxruntime cannot run: Relu (my.company)"),
])
def test_converter_input_it_cannot_take_is_one_line(tmp_path, opset, domain, words):
    path = tmp_path / "in.onnx"
    onnx.save(_qdq_model(opset, domain), str(path))
    line = _one_line(_cli("quantize-qat-export", str(path), str(tmp_path / "out.onnx")))
    assert words in line
    with pytest.raises(ModelError):
        quantize_qat_export(path, tmp_path / "out.onnx")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.onnx"]


@pytest.mark.parametrize("shape, dequantized", [((0, 3, 3, 3), False), ((0, 3, 3, 3), True), ((4, 0, 3, 3), True)])
def test_a_zero_size_weight_is_refused_naming_its_node(tmp_path, shape, dequantized):
    """A conv whose weight holds no values (float, or dequantized from int8): one ModelError naming the node that
    reads it and its shape, nothing written (it was a numpy reshape error naming nothing, or a 128-step refusal)."""
    from tests.support.onnx_graphs import Builder

    b = Builder()
    weight = b.const(np.zeros(shape, np.int8 if dequantized else np.float32), "w")
    if dequantized:
        weight = b.node("DequantizeLinear", [weight, b.const(np.float32(0.01)), b.const(np.int8(0))])
    y = b.qdq(b.node("Conv", [b.qdq("x", 0.05, 128), weight]), 0.1, 128)
    path = tmp_path / "in.onnx"
    onnx.save(b.model([("x", [1, shape[1], 6, 6])], [y]), str(path))
    reader = "DequantizeLinear 'DequantizeLinear" if dequantized else "Conv 'Conv"
    with pytest.raises(ModelError, match=rf"{reader}\d+' reads 'w\d+', a constant of shape \{list(shape)}\ that holds "
                                         "no values"):
        quantize_qat_export(path, tmp_path / "out.onnx")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.onnx"]


def test_a_tensor_verification_would_make_beyond_its_budget_is_refused_before_running(tmp_path):
    """A 1 kB model whose Tile makes 977 MB per sample: refused by shape inference before any session runs, naming
    the tensor, its node and shape (it ran onnxruntime for a minute to 2.7 GB and "out of memory", naming nothing)."""
    from tests.support.onnx_graphs import Builder

    b = Builder()
    tiled = b.node("Tile", [b.qdq("x", 0.05, 128), b.const(np.array([1, 4000, 4000], np.int64))])
    path = tmp_path / "in.onnx"
    onnx.save(b.model([("x", ["N", 4, 4])], [b.qdq(b.node("Relu", [tiled]), 0.1, 0)]), str(path))
    assert path.stat().st_size < 1024
    with pytest.raises(ModelError, match=r"in\.onnx: verification would make tensor 'tile\d+' \(made by Tile "
                                         r"'Tile\d+'\) of shape \[1, 16000, 16000\], 977 MB for one sample.*"
                                         r"--input-shape"):
        quantize_qat_export(path, tmp_path / "out.onnx")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.onnx"]


def test_a_missing_optional_package_is_one_line(tmp_path):
    code = ("import sys; sys.modules['matplotlib'] = None; from recal_app.cli import main; "
            f"sys.exit(main(['check', {str(DENSE)!r}, '--plot', {str(tmp_path / 'p.png')!r}]))")
    result = run_program(code=code, cwd=ROOT)
    assert "needs the Python package 'matplotlib'" in _one_line(result)


@pytest.mark.slow
def test_ctrl_c_keeps_the_last_checkpoint_and_exits_130(tmp_path):
    out = tmp_path / "run"
    # A shell starts background jobs with SIGINT ignored, and Python keeps an ignored SIGINT ignored: restore
    # the default, so the run sees the signal however the test suite itself was started (CI, nohup, &)
    process = subprocess.Popen([sys.executable, "-m", "recal_app.cli", "train", "--framework", "torch", "--recipe",
                                str(DENSE), "--output", str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, cwd=ROOT, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    for line in process.stdout:  # wait for the first epoch to complete
        if line.startswith("torch epoch 1/"):
            break
    process.send_signal(signal.SIGINT)
    _, stderr = process.communicate(timeout=300)
    lines = stderr.strip().splitlines()
    assert process.returncode == 130 and lines[-1].startswith("recal train: interrupted; the last complete checkpoint"), \
        stderr[-2000:]
    assert (out / "checkpoints" / "epoch-1.pt").is_file()
    assert not list(out.rglob(".recal-*"))
    resumed = run_program("-m", "recal_app.cli", "train", "--framework", "torch", "--recipe", str(DENSE), "--output",
                          str(out), "--resume", "--epochs", "2", "--no-progress", cwd=ROOT)
    assert resumed.returncode == 0, resumed.stderr[-2000:]


def test_a_torn_tensorflow_checkpoint_is_one_line_naming_it(tmp_path):
    tf = pytest.importorskip("tensorflow")
    from recal_app.run_lock import restore_checkpoint

    variable = tf.Variable(tf.ones([64, 64]))
    prefix = tf.train.Checkpoint(v=variable).write(str(tmp_path / "model.ckpt-1"))
    data = next(tmp_path.glob("model.ckpt-1.data-*"))
    data.write_bytes(data.read_bytes()[:100])  # killed mid-write, or copied in part
    fresh = tf.train.Checkpoint(v=tf.Variable(tf.zeros([64, 64])))
    with pytest.raises(ValueError, match=r"--resume: checkpoint .*model.ckpt-1 cannot be restored \(.*\): it is torn"):
        restore_checkpoint(lambda: fresh.read(prefix).assert_existing_objects_matched(), Path(prefix))


def test_sigterm_ends_a_command_as_ctrl_c_does_with_one_line(tmp_path):
    """SIGTERM (a scheduler's kill, a container's stop) gets the same clean end as Ctrl-C: one line, exit 143."""
    code = ("import sys, time, recal_app.cli as cli\n"
            "cli.load_recipe = lambda path: (print('ready', flush=True), time.sleep(60))\n"
            "sys.exit(cli.main(['check', 'recipe.yaml']))")
    process = subprocess.Popen([sys.executable, "-c", code], cwd=tmp_path, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    try:
        assert process.stdout.readline().strip() == "ready"
        process.send_signal(signal.SIGTERM)
        _, stderr = process.communicate(timeout=30)
    finally:
        process.kill()
    assert process.returncode == 143, stderr
    assert stderr.strip().splitlines() == ["recal check: terminated (SIGTERM)"], stderr


def test_a_recipe_that_is_a_fifo_a_device_or_a_folder_is_refused_at_once(tmp_path):
    """A FIFO would block the reader forever and /dev/zero never end (its size says 0): neither is opened."""
    fifo = tmp_path / "recipe.yaml"
    os.mkfifo(fifo)
    (tmp_path / "folder.yaml").mkdir()
    for path, kind in ((fifo, "a FIFO"), (Path("/dev/zero"), "a device"), (tmp_path / "folder.yaml", "a directory")):
        started = time.perf_counter()
        with pytest.raises(RecipeError, match=f"the recipe is {kind}, not a regular file"):
            load_recipe(str(path))
        assert time.perf_counter() - started < HANG_SECONDS


def test_no_command_writes_over_its_input_however_spelled(tmp_path):
    recipe = tmp_path / "r.yaml"
    shutil.copy(ROOT / "recal_core" / "recipes" / "prune.yaml", recipe)
    before = recipe.read_bytes()
    os.link(recipe, tmp_path / "hard.yaml")
    (tmp_path / "soft.yaml").symlink_to(recipe)
    for spelling in (recipe, tmp_path / "hard.yaml", tmp_path / "soft.yaml", tmp_path / "." / "r.yaml"):
        result = run_recal("check", str(recipe), "--plot", str(spelling))
        assert result.returncode == 2 and "refusing to write the plot" in result.stderr, (spelling, result.stderr)
    assert recipe.read_bytes() == before


@pytest.mark.parametrize("case", list(_converter_cases()), ids=lambda case: case[0])
def test_what_the_converter_once_raised_raw_is_a_located_refusal(tmp_path, case):
    """A NaN clamp bound, a sequence output, a Gemm bias the model itself cannot broadcast: one ModelError naming
    the node or tensor, at once; nothing written."""
    _, model, words = case
    started = time.perf_counter()
    with pytest.raises(ModelError, match=words):
        quantize_qat_export(model, tmp_path / "out.onnx")
    assert time.perf_counter() - started < HANG_SECONDS and not list(tmp_path.iterdir())


@pytest.mark.parametrize("values", ["int4", "ternary"])
def test_an_int4_weight_in_a_constant_node_converts_exactly(values):
    """An int4 weight held by a Constant node (once a raw error, then refused) with one scale for the whole tensor,
    transposed before its MatMul: MatMulNBits (2 bits where it is ternary), the same float output to the last bit.
    Left a DequantizeLinear before the MatMul, onnxruntime's default session fuses it into its own MatMulNBits at
    accuracy level 4 (the input quantized to int8), 0.4% off."""
    from onnx import TensorProto, helper

    from tests.support.onnx_graphs import Builder

    rng = np.random.default_rng(0)
    q = {"int4": rng.integers(-8, 8, 128), "ternary": rng.integers(-1, 2, 128)}[values]
    b = Builder()
    b.nodes.append(helper.make_node("Constant", [], ["w4"], value=helper.make_tensor(
        "w4", TensorProto.INT4, [8, 16], q.tolist())))
    y = b.node("MatMul", ["x", b.node("Transpose", [b.node("DequantizeLinear", ["w4", b.const(np.float32(0.1))])])])
    model = b.model([("x", [4, 16])], [y])
    model.opset_import[0].version, model.ir_version = 21, 10
    result = quantize_qat_export(model)
    assert [n.op_type for n in result.model.graph.node] == ["MatMulNBits"]
    assert result.verification.max_abs_diff == 0


def test_a_weight_only_gemm_whose_bias_is_a_column_runs_as_matmulnbits():
    """A Gemm bias of shape [N, 1] (valid where the batch is N) is not MatMulNBits' [N] bias: the layer stays a
    float Gemm with that reason, and the model converts and verifies; [1, N] becomes MatMulNBits' bias."""
    import warnings

    from recal_onnx import UnconvertedOpsWarning
    from tests.support.onnx_graphs import Builder

    feeds = {"x": np.random.default_rng(0).standard_normal((8, 16)).astype(np.float32)}
    for shape, nbits in (((8, 1), 0), ((1, 8), 1)):
        b = Builder()
        q = np.random.default_rng(0).integers(-7, 8, (8, 16)).astype(np.int8)
        w = b.node("DequantizeLinear", [b.const(q), b.const(np.full(8, 0.1, np.float32)),
                                        b.const(np.zeros(8, np.int8))], axis=0)
        y = b.node("Gemm", ["x", w, b.const(np.linspace(-1, 1, 8, dtype=np.float32).reshape(shape))], transB=1)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UnconvertedOpsWarning)
            result = quantize_qat_export(b.model([("x", [8, 16])], [y]), inputs=feeds)
        assert [n.op_type for n in result.model.graph.node].count("MatMulNBits") == nbits
        assert result.verification.problem(None) is None
        if not nbits:
            assert "[N] or [1, N]" in next(iter(result.float_reasons.values()))


def test_an_onnx_model_or_its_data_that_is_a_fifo_is_refused_at_once(tmp_path):
    """The ONNX model and every external data file it names go through the same gate as recipes: a FIFO (which
    would block the read forever) is refused naming it, before anything is read."""
    import time

    from recal_core.input_gate import InputFileError
    from tests.support.onnx_graphs import Builder

    fifo = tmp_path / "model.onnx"
    os.mkfifo(fifo)
    started = time.perf_counter()
    with pytest.raises(InputFileError, match=r"model.onnx: the ONNX model is a FIFO"):
        quantize_qat_export(fifo, tmp_path / "out.onnx")
    b = Builder()
    model = b.model([("x", [1, 4])], [b.qdq(b.node("Relu", [b.qdq("x", 0.1, 128)]), 0.1, 128)])
    weights = onnx.numpy_helper.from_array(np.ones((64, 64), np.float32), "big")
    model.graph.initializer.append(weights)
    onnx.external_data_helper.set_external_data(model.graph.initializer[-1], "weights.bin")
    model.graph.initializer[-1].ClearField("raw_data")
    onnx.save(model, tmp_path / "with_data.onnx")
    os.mkfifo(tmp_path / "weights.bin")
    with pytest.raises(InputFileError, match=r"weights.bin: the external data file of the ONNX model is a FIFO"):
        quantize_qat_export(tmp_path / "with_data.onnx", tmp_path / "out.onnx")
    assert time.perf_counter() - started < HANG_SECONDS
