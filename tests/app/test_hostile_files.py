"""Hostile files and faults, security and data loss: no code from data, no lost input, atomic outputs, resumes that
match their run, and no silent nonsense. Each test here failed before its fix (the red-team list in the README's
reliability section)."""

import hashlib
import json
import pickle
import shutil
import signal
import subprocess
import sys

import onnx
import pytest
import torch

from recal_app.run_lock import RUN_FILE, locked, run_identity
from recal_app.training import train
from recal_core import load_recipe
from recal_onnx import quantize_qat_export
from recal_torch import ScheduledModifierManager, export_onnx
from tests.app.hostile_inputs import (
    DENSE,
    KILLED_AFTER_THE_THIRD_SAVE,
    _cli,
    _Evil,
    _frozen_weights,
    _loads_quickly,
    _one_line,
)
from tests.support.forked import run_program
from tests.support.onnx_graphs import with_float_biases
from tests.support.paths import ROOT
from tests.support.torch_models import SmallCNN, batches, qat_small_cnn, train_steps


@pytest.fixture(scope="module")
def one_epoch_run(tmp_path_factory):
    """A one-epoch torch run (its recipe and output folder), trained once for the tamper cases to copy."""
    folder = tmp_path_factory.mktemp("one_epoch")
    out, recipe_path = folder / "run", folder / "one_epoch.yaml"
    recipe_path.write_text("- !EpochRangeModifier {start_epoch: 0, end_epoch: 1}\n")
    train(load_recipe(recipe_path), "torch", out, progress=False, quantize=False)
    return out, recipe_path


@pytest.fixture(scope="module")
def qat_model():
    return qat_small_cnn(4)


@pytest.mark.filterwarnings("ignore:Detected pickle protocol:UserWarning")
def test_a_crafted_checkpoint_runs_no_code(tmp_path):
    out, marker = tmp_path / "run", tmp_path / "pwned"
    (out / "checkpoints").mkdir(parents=True)
    recipe = load_recipe(DENSE)
    identity = run_identity("torch", 0, recipe.to_yaml(), recipe.max_epochs)
    (out / "checkpoints" / RUN_FILE).write_text(json.dumps(identity))
    with open(out / "checkpoints" / "epoch-99.pt", "wb") as f:
        pickle.dump({"epoch": 99, "model": _Evil(marker)}, f)
    with pytest.raises(ValueError, match="not a recal checkpoint that loads as data"):
        train(recipe, "torch", out, resume=True, progress=False)
    assert not marker.exists()


def test_a_checkpoint_missing_keys_is_one_line(tmp_path):
    out = tmp_path / "run"
    (out / "checkpoints").mkdir(parents=True)
    recipe = load_recipe(DENSE)
    (out / "checkpoints" / RUN_FILE).write_text(json.dumps(run_identity("torch", 0, recipe.to_yaml(), 1)))
    torch.save({"epoch": 1, "model": {}}, out / "checkpoints" / "epoch-1.pt")
    line = _one_line(_cli("train", "--framework", "torch", "--recipe", str(DENSE), "--output", str(out), "--resume"))
    assert "epoch-1.pt is not a complete recal checkpoint: it lacks optimizer, history, torch_rng" in line


@pytest.mark.parametrize("tamper, words", [
    (lambda w: w.to(torch.int8), "is torch.int8"), (lambda w: w.to(torch.float16), "is torch.float16"),
    (lambda w: w.bool(), "is torch.bool"), (lambda w: w.to(torch.complex64), "is torch.complex64"),
    (lambda w: w.index_fill(0, torch.tensor([0]), float("nan")), "holds non-finite values"),
    (lambda w: w.index_fill(0, torch.tensor([0]), float("inf")), "holds non-finite values")])
def test_a_checkpoint_of_another_dtype_or_with_nan_weights_is_refused(tmp_path, one_epoch_run, tamper, words):
    """load_state_dict would cast an int8, float16, bool or complex tensor silently, and load NaN weights: resume
    refuses both with one line naming the tensor, and the checkpoint is left as it is."""
    out, recipe_path = tmp_path / "run", one_epoch_run[1]
    shutil.copytree(one_epoch_run[0], out)  # this case's own copy of the one trained run
    path = out / "checkpoints" / "epoch-1.pt"
    state = torch.load(path, weights_only=True)
    key = next(k for k, v in state["model"].items() if v.is_floating_point() and v.dim() > 1)
    state["model"][key] = tamper(state["model"][key])
    torch.save(state, path)
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    line = _one_line(_cli("train", "--framework", "torch", "--recipe", str(recipe_path), "--output", str(out),
                          "--resume"))
    assert f"epoch-1.pt: {key!r} {words}" in line, line
    assert hashlib.sha256(path.read_bytes()).hexdigest() == digest and not (out / "checkpoints" / "epoch-2.pt").exists()


def test_the_converter_never_overwrites_what_the_input_reads(tmp_path, qat_model):
    folder = tmp_path / "model_dir"
    folder.mkdir()
    src = export_onnx(qat_model, torch.randn(1, 1, 8, 8), tmp_path / "plain.onnx", dynamo=False)
    model = onnx.load(str(src))
    onnx.save_model(model, str(folder / "qat.onnx"), save_as_external_data=True, all_tensors_to_one_file=True,
                    location="weights.bin", size_threshold=0)
    digests = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in folder.iterdir()}
    for target in (folder / "weights.bin", folder / "qat.onnx", tmp_path / ".." / tmp_path.name / "model_dir" / "qat.onnx"):
        with pytest.raises(ValueError, match="the input model reads that file"):
            quantize_qat_export(folder / "qat.onnx", target)
    onnx.save_model(onnx.load(str(src)), str(folder / "other.onnx"), save_as_external_data=True,
                    all_tensors_to_one_file=True, location="out.onnx.data", size_threshold=0)
    digests = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in folder.iterdir()}
    with pytest.raises(ValueError, match="out.onnx.data: the input model reads"):  # out.onnx's data file
        quantize_qat_export(folder / "other.onnx", folder / "out.onnx")
    assert {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in folder.iterdir()} == digests
    result = quantize_qat_export(folder / "qat.onnx", folder / "int8.onnx")  # beside it is fine
    assert result.path.is_file()


def test_one_run_per_output_folder_and_resumes_match_their_run(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    recipe = load_recipe(DENSE)
    with locked(out):  # another run is writing (a lock this process holds is its own: the run is another process)
        line = _one_line(run_program("-m", "recal_app.cli", "train", "--framework", "torch", "--recipe", str(DENSE),
                                     "--output", str(out), cwd=ROOT))
        assert "another recal run is writing" in line
    train(recipe, "torch", out, epochs=1, progress=False, quantize=False)
    line = _one_line(_cli("train", "--framework", "torch", "--recipe", str(DENSE), "--output", str(out)))
    assert "holds an earlier run's checkpoints; continue it with --resume" in line
    for extra, words in ((["--seed", "1"], "--seed 0"), (["--framework", "tf"], "--framework 'torch'")):
        args = ["train", "--framework", "torch", "--recipe", str(DENSE), "--output", str(out), "--resume", *extra]
        if "--framework" in extra:
            args = args[:1] + args[3:]
        line = _one_line(_cli(*args))
        assert f"were written with {words}" in line, line


@pytest.mark.slow
def test_tf_resume_after_a_sigkill_between_checkpoint_and_history_is_exact(tmp_path):
    """A run killed by SIGKILL (in its own process) after epoch 3's checkpoint, before the history that commits it:
    the resumed run repeats epoch 3 and ends with the uninterrupted run's weights."""
    recipe = ROOT / "recal_core" / "recipes" / "prune.yaml"
    a = train(load_recipe(recipe), "tf", tmp_path / "a", epochs=3, progress=False)
    killed = run_program(str(recipe), str(tmp_path / "b"), code=KILLED_AFTER_THE_THIRD_SAVE, cwd=ROOT)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    b = train(load_recipe(recipe), "tf", tmp_path / "b", epochs=3, resume=True, progress=False)
    assert [h.loss for h in a.history] == [h.loss for h in b.history]
    assert _frozen_weights(tmp_path / "a" / "model.pb") == _frozen_weights(tmp_path / "b" / "model.pb")


def test_outputs_get_the_mode_of_any_new_file_and_stale_temporaries_go(tmp_path):
    from recal_core.atomic import TEMP_PREFIX, _seal, write_text_atomically

    plain = tmp_path / "plain.txt"
    plain.write_text("x")
    write_text_atomically(tmp_path / "atomic.txt", "x")
    assert (tmp_path / "atomic.txt").stat().st_mode == plain.stat().st_mode
    out = tmp_path / "run"
    (out / "checkpoints").mkdir(parents=True)
    sealed = f"{TEMP_PREFIX}4000000-{_seal(4000000)}-"  # what kill -9 leaves: recal's names, sealed
    stale = [out / f"{sealed}report.json.abc.tmp", out / "checkpoints" / f"{sealed}epoch-1.pt.x.tmp"]
    for path in stale:
        path.write_bytes(b"")
    users = [out / "checkpoints" / name for name in ("keep.txt", f"{TEMP_PREFIX}4000000-notes.tmp",
                                                     f"{TEMP_PREFIX}4000000-deadbeef-x.tmp")]
    for path in users:  # the user's own files, two named like temporaries but not sealed
        path.write_text("not recal's")
    with pytest.raises(RuntimeError, match="earlier run"):  # refused, but the stale files are cleaned first
        train(load_recipe(DENSE), "torch", out, epochs=1, progress=False)
    assert not any(p.exists() for p in stale) and all(p.exists() for p in users)


def test_a_killed_conversions_temporary_folder_goes_with_the_next_conversion_and_a_live_ones_stays(tmp_path,
                                                                                                  qat_model):
    """A conversion killed by SIGKILL leaves its ``.recal-<pid>-<seal>-...`` folder; the next conversion into that
    folder removes it (its process is gone) and leaves a running writer's alone, and a user's file named like one
    without the seal."""
    from recal_core.atomic import _seal, _writer_pid

    def killed_pid(path):
        return _writer_pid(path.name)

    src = export_onnx(qat_model, torch.randn(1, 1, 8, 8), tmp_path / "qat.onnx", dynamo=False)
    out = tmp_path / "out"
    out.mkdir()
    killer = ("import os, signal, sys; import recal_core.atomic as a; from recal_onnx import quantize_qat_export\n"
              "real = a.os.replace\n"
              "def die(*args): os.kill(os.getpid(), signal.SIGKILL)\n"
              "a.os.replace = die\n"
              "quantize_qat_export(sys.argv[1], sys.argv[2])")
    killed = run_program(str(src), str(out / "int8.onnx"), code=killer, timeout=300)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    (orphan,) = out.iterdir()  # the killed conversion's folder, its model inside, nothing published
    assert orphan.name.startswith(".recal-") and list(orphan.iterdir())
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        live = out / f".recal-{sleeper.pid}-{_seal(sleeper.pid)}-writing"
        live.mkdir()
        mine = out / f".recal-{killed_pid(orphan)}-my-notes"  # the user's, named like one but unsealed
        mine.write_text("kept")
        quantize_qat_export(str(src), out / "int8.onnx")
        # the int8 model and its twin for x86 without VNNI (8-bit weights, target any)
        assert sorted(p.name for p in out.iterdir()) == sorted([live.name, mine.name, "int8.onnx",
                                                                "int8.x86-avx2.onnx"])
    finally:
        sleeper.kill()
        sleeper.wait()


def test_a_full_disk_is_said_plainly_and_leaves_nothing(tmp_path, monkeypatch):
    import shutil
    from collections import namedtuple

    from recal_core.atomic import atomic_path

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10**9, 10**9, 0))
    with pytest.raises(OSError, match="no space left on the device of .* while writing epoch-1.pt"):
        with atomic_path(tmp_path / "epoch-1.pt") as tmp:
            tmp.write_bytes(b"partial")
            raise RuntimeError("[enforce fail at inline_container.cc:664] PytorchStreamWriter failed writing file")
    assert list(tmp_path.iterdir()) == []


def test_an_error_while_writing_names_the_users_path_not_recals_temporary(tmp_path):
    """A writer's error inside recal's atomic write names the output the user asked for: the temporary
    (``.recal-<pid>-...``) the writer saw is put back to that path, in the message and in an OSError's file name."""
    import errno

    from recal_core.atomic import atomic_folder, atomic_path

    with pytest.raises(ValueError) as raised:
        with atomic_path(tmp_path / "model.pt") as tmp:
            raise ValueError(f"cannot write {tmp}: the writer's own words")
    assert str(raised.value) == f"cannot write {tmp_path / 'model.pt'}: the writer's own words"
    with pytest.raises(PermissionError) as raised:
        with atomic_folder(tmp_path) as folder:
            raise PermissionError(errno.EACCES, "Permission denied", str(folder / "out.onnx"))
    assert raised.value.filename == str(tmp_path / "out.onnx") and ".recal-" not in str(raised.value)
    assert list(tmp_path.iterdir()) == []


def test_bad_input_leaves_no_folder_behind(tmp_path):
    recipe = tmp_path / "layers.yaml"
    recipe.write_text("- !EpochRangeModifier {start_epoch: 0, end_epoch: 1}\n- !ConstantKSModifier {params: [nope]}\n")
    _one_line(_cli("train", "--framework", "torch", "--recipe", str(recipe), "--output", str(tmp_path / "new")))
    assert not (tmp_path / "new").exists()


def test_confusable_names_are_shown_escaped():
    message = _loads_quickly("- !GradualKSModifier {params: [conv1], init_sp\u0430rsity: 0.5, final_sparsity: 0.8,"
                             " start_epoch: 0, end_epoch: 3, update_frequency: 1}")
    assert "init_sp\\u0430rsity" in message and message.isascii(), message  # a Cyrillic 'a', shown as such


def test_duplicate_keys_and_yaml11_surprises_are_errors():
    assert "key 'modifiers' given twice (first at line 1)" in _loads_quickly(
        "modifiers:\n- !EpochRangeModifier {start_epoch: 0, end_epoch: 3}\n"
        "modifiers:\n- !EpochRangeModifier {start_epoch: 0, end_epoch: 300}\n")
    assert "key 'gamma' given twice" in _loads_quickly(
        "- !LearningRateModifier {start_epoch: 0, lr_class: ExponentialLR, lr_kwargs: {gamma: 0.9, gamma: 0.5}, "
        "init_lr: 0.1}\n- !EpochRangeModifier {start_epoch: 0, end_epoch: 3}")
    assert "key 'epochs' given twice" in _loads_quickly(
        "epochs: 3\nepochs: 30\nmodifiers:\n- !EpochRangeModifier {start_epoch: 0, end_epoch: eval(epochs)}")
    assert "field 'end_epoch': Input should be a valid number; got '1:30'" in _loads_quickly(
        "- !EpochRangeModifier {start_epoch: 0, end_epoch: 1:30}")
    assert "Input should be a valid boolean; got 'yes'" in _loads_quickly(
        "- !ConstantKSModifier {params: __ALL__}\n- !TrainableParamsModifier {params: __ALL__, trainable: yes}")
    assert load_recipe("- !EpochRangeModifier {start_epoch: 0, end_epoch: 010}").max_epochs == 10  # not octal 8


def test_an_lr_that_underflows_or_overflows_is_a_located_error():
    for gamma, words in (("1e-300", "underflows to 0"), ("1e300", "overflows")):
        text = ("- !LearningRateModifier {start_epoch: 0, end_epoch: 50, lr_class: ExponentialLR, "
                f"lr_kwargs: {{gamma: {gamma}}}, init_lr: 0.1}}")
        assert "<string>:1:" in _loads_quickly(text) and words in _loads_quickly(text)
    path = ROOT / "recal_core" / "recipes" / "seed_lr_schedule.yaml"
    bad = path.read_text().replace("gamma: 0.9", "gamma: 1e300") if "gamma: 0.9" in path.read_text() else None
    if bad is not None:
        assert "overflows" in _loads_quickly(bad)


def test_verification_cannot_be_switched_off_by_nan(tmp_path, qat_model):
    src = export_onnx(qat_model, torch.randn(1, 1, 8, 8), tmp_path / "qat.onnx", dynamo=False)
    for value in ("nan", "-1", "inf"):
        line = _one_line(_cli("quantize-qat-export", str(src), str(tmp_path / "o.onnx"), "--tolerance", value))
        assert "expected a finite number >= 0" in line
    # recal's export writes each bias on its int32 grid, so its conversion is exact; another exporter's float
    # biases sit between steps, which the int8 model cannot hold: a tolerance of 0 refuses that conversion
    with_float_biases(src, tmp_path / "float_biases.onnx")
    converted = _cli("quantize-qat-export", str(tmp_path / "float_biases.onnx"), str(tmp_path / "o.onnx"))
    assert converted.returncode == 0 and "float biases lay between the int32 steps" in converted.stdout  # said
    (tmp_path / "o.onnx").unlink()
    line = _one_line(_cli("quantize-qat-export", str(tmp_path / "float_biases.onnx"), str(tmp_path / "o.onnx"),
                          "--tolerance", "0"), code=1)
    assert "does not match the input model" in line and not (tmp_path / "o.onnx").exists()
    assert "4 float biases lay between the int32 steps" in line  # and why it may not


def test_a_checkpoint_that_does_not_fit_changes_nothing():
    model = SmallCNN()
    recipe = ("- !GradualKSModifier {params: __ALL_PRUNABLE__, init_sparsity: 0.3, final_sparsity: 0.6, "
              "start_epoch: 0, end_epoch: 2, update_frequency: 1}")
    manager = ScheduledModifierManager.from_yaml(recipe)
    optimizer = manager.modify(model, torch.optim.SGD(model.parameters(), lr=0.1), steps_per_epoch=2)
    train_steps(model, optimizer, batches(3))
    state = manager.state_dict()
    state["step"] = 1
    state["masks"]["fc.weight"] = {0: torch.ones(3, 3)}
    before = (manager.step, {k: v.clone() for k, v in manager.masks.effective.items()})
    with pytest.raises(ValueError, match=r"mask of 'fc.weight' \(modifier 0\) has shape \(3, 3\)"):
        optimizer.load_state_dict({**optimizer.state_dict(), "recal": state})
    assert manager.step == before[0] == 3
    assert all(torch.equal(before[1][k], v) for k, v in manager.masks.effective.items())
