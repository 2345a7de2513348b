"""`recal train` end to end (small recipes, few epochs): artefacts, report, resume, bad input."""

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from recal_core import load_recipe
from recal_app.training import train

from tests.support.cli_in_process import run_recal
from tests.support.paths import ROOT
from tests.support.forked import run_program

PRUNE_QAT = """
- !EpochRangeModifier {start_epoch: 0, end_epoch: 4}
- !LearningRateModifier {start_epoch: 0, end_epoch: 3, lr_class: ExponentialLR, lr_kwargs: {gamma: 0.7}, init_lr: 0.05}
- !GradualKSModifier {params: __ALL_PRUNABLE__, init_sparsity: 0.2, final_sparsity: 0.6, start_epoch: 0,
                      end_epoch: 2, update_frequency: 0.5}
- !QuantizationModifier {start_epoch: 3}
"""
PRUNE = """
- !EpochRangeModifier {start_epoch: 0, end_epoch: 3}
- !GradualKSModifier {params: __ALL_PRUNABLE__, init_sparsity: 0.2, final_sparsity: 0.6, start_epoch: 0,
                      end_epoch: 2, update_frequency: 0.5}
"""


def _recipe(tmp_path, text, name="recipe.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return load_recipe(path)


@pytest.mark.slow
def test_torch_train_writes_every_artefact(tmp_path):
    out = tmp_path / "out"
    run = train(_recipe(tmp_path, PRUNE_QAT), "torch", out, progress=False)
    names = {a.name: a for a in run.artefacts}
    assert set(names) == {"PyTorch model (QAT, fake-quantized)", "QAT ONNX export (QDQ)",
                          "int8 ONNX (quantize_qat_export)"}
    for a in run.artefacts:
        assert a.accuracy > 0.8 and a.sparsity == pytest.approx(0.6, abs=0.01) and a.latency_ms > 0
    assert names["int8 ONNX (quantize_qat_export)"].runtime.startswith("onnxruntime")
    for f in ("model.pt", "model.onnx", "model.int8.onnx", "report.json", "report.md", "schedule.png"):
        assert (out / f).is_file(), f
    assert list((out / "tensorboard").glob("events.out.tfevents.*"))
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == [f"epoch-{i}.pt" for i in range(1, 5)] + ["run.json"]
    report = json.loads((out / "report.json").read_text())
    assert len(report["history"]) == 4 and report["artefacts"][2]["accuracy"] > 0.8
    assert "| int8 ONNX (quantize_qat_export) |" in (out / "report.md").read_text()
    assert not list(out.glob(".recal-*"))  # no temp files left (the lock file .recal.lock stays)


@pytest.mark.slow
def test_torch_resume_gives_the_uninterrupted_result(tmp_path):
    recipe = _recipe(tmp_path, PRUNE_QAT)
    train(recipe, "torch", tmp_path / "a", progress=False, quantize=False)
    train(recipe, "torch", tmp_path / "b", epochs=2, progress=False, quantize=False)  # stops early
    run = train(recipe, "torch", tmp_path / "b", resume=True, progress=False, quantize=False)
    assert [h.epoch for h in run.history] == [1, 2, 3, 4]
    a = torch.load(tmp_path / "a" / "model.pt")
    b = torch.load(tmp_path / "b" / "model.pt")
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


def _stopped_before_qat_then_resumed(recipe, framework, out):
    """Two epochs of PRUNE_QAT (QAT starts at epoch 3): exported float, warned; then resumed to the end."""
    with pytest.warns(UserWarning, match="QAT had not run"):
        stopped = train(recipe, framework, out, epochs=2, progress=False)
    assert not any(a.qat for a in stopped.artefacts)
    return train(recipe, framework, out, resume=True, progress=False)


@pytest.mark.slow
def test_tf_train_and_resume(tmp_path):
    pytest.importorskip("tensorflow")
    pytest.importorskip("tf2onnx")
    recipe = _recipe(tmp_path, PRUNE_QAT)
    full = train(recipe, "tf", tmp_path / "a", progress=False)
    artefact, qdq, int8 = full.artefacts
    assert artefact.path.endswith("model.pb") and artefact.accuracy > 0.8
    assert artefact.sparsity == pytest.approx(0.6, abs=0.01)
    assert qdq.qat and qdq.path.endswith("model.onnx") and int8.path.endswith("model.int8.onnx")
    # every artefact's sparsity read off its own weights: the QDQ export's float weights behind Q -> DQ too
    assert qdq.sparsity == pytest.approx(0.6, abs=0.01) and int8.sparsity == pytest.approx(0.6, abs=0.01)
    assert abs(int8.accuracy - artefact.accuracy) <= 1 / 360  # the int8 model is as accurate as the TF graph
    assert list((tmp_path / "a" / "tensorboard").glob("events.out.tfevents.*"))
    resumed = _stopped_before_qat_then_resumed(recipe, "tf", tmp_path / "b")
    assert [h.epoch for h in resumed.history] == [1, 2, 3, 4]
    assert resumed.artefacts[0].sparsity == artefact.sparsity
    assert resumed.history[-1].test_accuracy == pytest.approx(full.history[-1].test_accuracy, abs=0.02)


@pytest.mark.slow
def test_keras_train_and_resume(tmp_path):
    """Pruning then QAT in Keras: the QDQ export converts to an int8 model as accurate as it; a run stopped after
    two epochs and resumed gives the uninterrupted run's outputs."""
    pytest.importorskip("keras")
    pytest.importorskip("tf2onnx")
    ort = pytest.importorskip("onnxruntime")
    from recal_core.datasets import load_digits

    recipe = _recipe(tmp_path, PRUNE_QAT)
    full = train(recipe, "keras", tmp_path / "a", progress=False)
    qdq, int8 = full.artefacts
    assert qdq.qat and qdq.path.endswith("model.onnx") and int8.path.endswith("model.int8.onnx")
    assert int8.accuracy > 0.8 and abs(int8.accuracy - qdq.accuracy) <= 1 / 360  # at most one test digit apart
    assert int8.sparsity == pytest.approx(0.6, abs=0.01) and int8.size_bytes < qdq.size_bytes / 2
    assert qdq.sparsity == pytest.approx(0.6, abs=0.01)  # read off the export's own weights, Q/DQ followed
    assert list((tmp_path / "a" / "tensorboard").rglob("events.out.tfevents.*"))
    resumed = _stopped_before_qat_then_resumed(recipe, "keras", tmp_path / "b")
    assert [h.epoch for h in resumed.history] == [1, 2, 3, 4]
    x = load_digits().test_images[..., None]
    logits = [ort.InferenceSession(str(tmp_path / d / "model.onnx")).run(None, {"inputs": x})[0] for d in "ab"]
    np.testing.assert_allclose(logits[0], logits[1], rtol=1e-4, atol=1e-4)  # resumed = uninterrupted


def _cli_process(*args):
    return subprocess.run([sys.executable, "-m", "recal_app.cli", *args], capture_output=True, text=True, cwd=ROOT)


_cli = run_recal  # in this process: most cases check one refusal's line (tests/support/cli_in_process.py)


def test_bad_input_is_one_line_and_keeps_earlier_outputs(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "report.md").write_text("earlier run")
    before = hashlib.sha256((out / "report.md").read_bytes()).hexdigest()
    bad = tmp_path / "bad.yaml"
    bad.write_text("- !GradualKSModifier {params: __ALL__, init_sparsity: 2, final_sparsity: 3, start_epoch: 0, "
                   "end_epoch: 1, update_frequency: 1}\n")
    wrong_layers = tmp_path / "layers.yaml"
    wrong_layers.write_text("- !EpochRangeModifier {start_epoch: 0, end_epoch: 1}\n"
                            "- !ConstantKSModifier {params: [encoder.layer.0]}\n")
    a_file = tmp_path / "file"
    a_file.write_text("x")
    cases = [
        (["--recipe", str(tmp_path / "missing.yaml")], "recipe file not found"),
        (["--recipe", str(bad)], "bad.yaml:1:"),
        (["--recipe", str(wrong_layers), "--output", str(tmp_path / "fresh")], "matches no prunable parameter"),
        (["--recipe", str(ROOT / "recal_core/recipes/dense.yaml"), "--output", str(a_file / "sub")], "not writable"),
        (["--recipe", str(wrong_layers), "--resume"], "no checkpoint"),
    ]
    for extra, words in cases:
        args = ["train", "--framework", "torch", "--output", str(out), "--no-progress", *extra]
        result = _cli(*args)
        assert result.returncode != 0, extra
        err = result.stderr.strip().splitlines()
        assert len(err) == 1 and words in err[0], (extra, result.stderr)
    assert hashlib.sha256((out / "report.md").read_bytes()).hexdigest() == before
    assert sorted(p.name for p in out.iterdir()) == ["report.md"] and not (tmp_path / "fresh").exists()
    # a good recipe into that folder: the user's files are named, not replaced (exit 2, nothing written)
    (out / "model.onnx").write_bytes(b"the user's model")
    result = _cli("train", "--framework", "torch", "--output", str(out), "--no-progress", "--recipe",
                  str(ROOT / "recal_core/recipes/dense.yaml"))
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert "holds files recal did not write (model.onnx, report.md)" in result.stderr
    assert sorted(p.name for p in out.iterdir()) == ["model.onnx", "report.md"]
    assert (out / "model.onnx").read_bytes() == b"the user's model"


def test_resume_without_checkpoint_is_a_clear_error(tmp_path):
    result = _cli("train", "--framework", "torch", "--recipe", str(ROOT / "recal_core/recipes/dense.yaml"),
                  "--output", str(tmp_path / "empty"), "--resume", "--no-progress")
    assert result.returncode == 2 and "no checkpoint" in result.stderr


@pytest.mark.slow
def test_make_demo_script(tmp_path):
    result = run_program(str(ROOT / "scripts" / "demo.py"), "--output", str(tmp_path / "demo"), "--no-progress",
                         "--speed-size", "64", "--rounds", "3", cwd=ROOT, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    table = [line for line in result.stdout.splitlines() if line.startswith(("torch ", "tf "))]
    # 85% unstructured can leave a channel no one reads: then a thinned PyTorch model is listed too
    thinned = [line for line in table if "PyTorch model, thinned" in line]
    assert len(table) - len(thinned) == 8 and len(thinned) <= 1, result.stdout
    for line in table:
        accuracy = float(line.split()[-4])
        assert accuracy > 0.9, line
    assert (tmp_path / "demo" / "torch-prune-quant" / "model.int8.onnx").is_file()
    assert (tmp_path / "demo" / "tf-prune-quant" / "model.int8.onnx").is_file()
    assert "1. accuracy on real data" in result.stdout and "2. speed on synthetic inputs" in result.stdout
    demo = json.loads((tmp_path / "demo" / "demo.json").read_text())  # every printed figure, saved
    assert [job["accuracy"] for job in demo["jobs"]] == pytest.approx([float(line.split()[-4]) for line in table],
                                                                      abs=5e-5)
    rows = {row["label"].split(" (")[0]: row for row in demo["speed"]["rows"]}
    assert list(rows) == ["fp32", "recal int8", "ort quantize_static", "ort quantize_static reduce_range",
                          "recal 50% filters + 7-bit QAT int8, thinned"]
    fp32, recal, thinned = rows["fp32"], rows["recal int8"], rows["recal 50% filters + 7-bit QAT int8, thinned"]
    assert recal["size_mb"] <= 0.27 * fp32["size_mb"] and recal["latency_ms"] > 0  # a quarter of fp32's size
    assert thinned["size_mb"] <= 0.07 * fp32["size_mb"]  # a quarter of the channels' weights, in int8
    assert recal["steps"] <= 1 + 1e-3 and thinned["steps"] <= 1 + 1e-3  # within one output step of the QAT export
    assert all(0 <= row["agreement"] <= 1 for row in rows.values())
    assert "Measured this run: recal int8" in result.stdout and demo["speed"]["measured"] in result.stdout


@pytest.mark.slow
def test_recal_demo_runs_from_any_folder_with_what_is_installed(tmp_path):
    """``recal demo`` is the package's own: from a folder away from the checkout, PyTorch only here, the recipe
    read by name; the table and demo.json hold the same figures."""
    exe = Path(sys.executable).parent / "recal"
    result = run_program(str(exe), "demo", "--framework", "torch", "--output", "out", "--no-progress",
                         cwd=tmp_path, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    table = [line for line in result.stdout.splitlines() if line.startswith("torch ")]
    saved = json.loads((tmp_path / "out" / "demo.json").read_text())
    assert [job["accuracy"] for job in saved["jobs"]] == pytest.approx([float(line.split()[-4]) for line in table],
                                                                       abs=5e-5)
    assert all(job["framework"] == "torch" for job in saved["jobs"]) and len(table) >= 6
    assert (tmp_path / "out" / "torch-prune-quant" / "model.int8.onnx").is_file()
    assert not (tmp_path / "out" / "tf-prune-quant").exists()


def test_a_second_demo_replaces_its_own_earlier_run_only(tmp_path):
    """`make demo` twice works: a folder holding an earlier demo job (its report.md) is replaced; a folder that
    is not one is left as it is (training then refuses it with its own message)."""
    from recal_app import demo

    earlier, other = tmp_path / "earlier", tmp_path / "other"
    for folder in (earlier, other):
        (folder / "checkpoints").mkdir(parents=True)
    (earlier / "report.md").write_text("an earlier demo run")
    (other / "notes.txt").write_text("the user's")
    demo._replace_earlier_demo_run(earlier)
    demo._replace_earlier_demo_run(other)
    assert not earlier.exists() and (other / "notes.txt").read_text() == "the user's"


def test_progress_in_a_log_is_one_line_per_epoch(tmp_path):
    """Not a terminal (a pipe, as in CI logs): no live bars, one line per epoch on stdout."""
    result = run_program("-m", "recal_app.cli", "train", "--framework", "torch", "--recipe",
                         str(ROOT / "recal_core/recipes/dense.yaml"), "--output", str(tmp_path / "run"), "--epochs", "2",
                         cwd=ROOT)
    assert result.returncode == 0, result.stderr[-2000:]
    epochs = [line for line in result.stdout.splitlines() if line.startswith("torch epoch")]
    assert [line.split(":")[0] for line in epochs] == ["torch epoch 1/2", "torch epoch 2/2"]
    assert "\r" not in result.stderr and "it/s" not in result.stderr


def test_progress_bar_is_live_on_a_terminal(monkeypatch):
    from recal_app.training import progress_bar

    monkeypatch.setattr("sys.stderr.isatty", lambda: True)
    assert not progress_bar(range(3), "x", True).disable
    monkeypatch.setattr("sys.stderr.isatty", lambda: False)
    assert progress_bar(range(3), "x", True).disable and progress_bar(range(3), "x", False).disable


DIVERGING = """
- !EpochRangeModifier {start_epoch: 0, end_epoch: 3}
- !SetLearningRateModifier {start_epoch: 1, learning_rate: 1.0e+12}
- !GradualKSModifier {params: __ALL_PRUNABLE__, init_sparsity: 0.5, final_sparsity: 0.8, start_epoch: 0,
                      end_epoch: 2, update_frequency: 0.5}
"""


@pytest.mark.slow
@pytest.mark.parametrize("framework", ["torch", "tf", "keras"])
def test_a_diverging_run_stops_at_the_step_keeps_its_checkpoint_and_exports_nothing(tmp_path, framework):
    """A recipe LR of 1e12 from epoch 1: the loss or the weights stop being finite during epoch 2. The run stops with
    one line naming the step, epoch 1's checkpoint stays, and no model is written."""
    from recal_app.errors import DivergedError

    out = tmp_path / "out"
    with pytest.raises(DivergedError, match=rf"^{framework} training diverged at step \d+: (the loss|a weight) is"):
        train(_recipe(tmp_path, DIVERGING), framework, out, progress=False)
    assert not list(out.glob("model*")), list(out.iterdir())
    history = out / "checkpoints" / ("epoch-1.pt" if framework == "torch" else "history.json")
    assert history.is_file() and not (out / "checkpoints" / "epoch-2.pt").exists()
    if framework != "torch":
        assert json.loads(history.read_text())["epoch"] == 1
    line = _cli("train", "--framework", framework, "--recipe", str(tmp_path / "recipe.yaml"), "--output",
                str(tmp_path / "cli"), "--no-progress")
    assert line.returncode == 2 and len(line.stderr.strip().splitlines()) == 1 and "diverged at step" in line.stderr


def test_a_pruned_weight_is_exactly_zero_whatever_value_it_held():
    """Masks zero a pruned weight (masked_fill), they do not multiply it: a NaN or an infinity there becomes 0."""
    from recal_torch import ScheduledModifierManager

    model = torch.nn.Sequential(torch.nn.Linear(8, 8))
    manager = ScheduledModifierManager.from_yaml(
        "- !ConstantKSModifier {params: __ALL_PRUNABLE__, start_epoch: 0, end_epoch: 2}\n"
        "- !EpochRangeModifier {start_epoch: 0, end_epoch: 2}")
    with torch.no_grad():
        model[0].weight[:, :4] = 0.0  # the constant mask: these stay zero
    optimizer = manager.modify(model, torch.optim.SGD(model.parameters(), lr=0.1), steps_per_epoch=2)
    with torch.no_grad():
        model[0].weight[0, 0], model[0].weight[1, 1] = float("nan"), float("inf")  # at pruned places
    optimizer.zero_grad()
    model(torch.randn(4, 8)).sum().backward()
    optimizer.step()
    assert int((model[0].weight[:, :4] == 0).sum()) == 32
