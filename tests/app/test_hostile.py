"""Hostile files and faults: no code from data, no lost input, bounded time and memory, one clear line.

Each test here failed before its fix (the red-team list in the README's reliability section).
"""

import hashlib
import json
import os
import pickle
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from unittest import mock

import numpy as np
import onnx
import pytest
import torch

from recal_core import RecipeError, load_recipe
from recal_core.expressions import ExpressionBudget
from recal_app.run_lock import RUN_FILE, locked, run_identity
from recal_app.training import train
from recal_onnx import ModelError, quantize_qat_export
from recal_torch import ScheduledModifierManager, export_onnx

from tests.support.cli_in_process import run_recal
from tests.support.paths import ROOT
from tests.support.forked import run_program
from tests.support.hang_guard import HANG_SECONDS
from tests.support.onnx_graphs import with_float_biases
from tests.support.torch_models import SmallCNN, batches, qat_small_cnn, train_steps

DENSE = ROOT / "recal_core" / "recipes" / "dense.yaml"


_cli = run_recal  # in this process: most cases check one refusal's line (tests/support/cli_in_process.py)


def _one_line(result, code=2):
    lines = result.stderr.strip().splitlines()
    assert result.returncode == code and len(lines) == 1, (result.returncode, result.stderr[-2000:])
    return lines[0]


def _loads_quickly(text, peak_bytes=None):
    """The recipe is refused, not hung (:data:`HANG_SECONDS`); with ``peak_bytes``, also without allocating that
    much on the way (memory is the deterministic sign that a costly operation was refused before it ran; traced only
    where asked: tracing slows Python down)."""
    import tracemalloc

    started = time.perf_counter()
    if peak_bytes is not None:
        tracemalloc.start()
    try:
        with pytest.raises(RecipeError) as err:
            load_recipe(text).bind(100)
        peak = tracemalloc.get_traced_memory()[1] if peak_bytes is not None else 0
    finally:
        if peak_bytes is not None:
            tracemalloc.stop()
    assert time.perf_counter() - started < HANG_SECONDS
    assert peak_bytes is None or peak < peak_bytes, f"{peak:,} bytes allocated on the way to the refusal"
    assert "internal error" not in str(err.value)
    return str(err.value)


# --- security and data loss ----------------------------------------------------------------------


class _Evil:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


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


@pytest.fixture(scope="module")
def one_epoch_run(tmp_path_factory):
    """A one-epoch torch run (its recipe and output folder), trained once for the tamper cases to copy."""
    folder = tmp_path_factory.mktemp("one_epoch")
    out, recipe_path = folder / "run", folder / "one_epoch.yaml"
    recipe_path.write_text("- !EpochRangeModifier {start_epoch: 0, end_epoch: 1}\n")
    train(load_recipe(recipe_path), "torch", out, progress=False, quantize=False)
    return out, recipe_path


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


@pytest.fixture(scope="module")
def qat_model():
    return qat_small_cnn(4)


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


KILLED_AFTER_THE_THIRD_SAVE = """
import os, signal, sys
import recal_app.tf_trainer as tf_train
from recal_core import load_recipe
from recal_app.training import train

real, calls = tf_train.write_text_atomically, []


def killed_after_the_third_save(path, text):
    calls.append(path)
    if len(calls) == 3:  # epoch 3's checkpoint is saved, its history.json never written
        os.kill(os.getpid(), signal.SIGKILL)  # no finally block, no atexit, no flush: what kill -9 does
    return real(path, text)


tf_train.write_text_atomically = killed_after_the_third_save
train(load_recipe(sys.argv[1]), "tf", sys.argv[2], epochs=3, progress=False)
"""


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


def _frozen_weights(path):
    """The constants of a frozen graph, as bytes (two identical runs serialise the GraphDef differently)."""
    import tensorflow as tf

    graph = tf.compat.v1.GraphDef()
    graph.ParseFromString(path.read_bytes())
    return {n.name: n.attr["value"].tensor.tensor_content for n in graph.node if n.op == "Const"}


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


# --- unbounded time or memory from a small file --------------------------------------------------


def test_alias_bombs_recursion_and_deep_nesting_are_located_and_fast():
    levels = ["a: &a [1, 1, 1, 1, 1, 1, 1, 1, 1, 1]"]
    for i, name in enumerate("bcdefghi"):
        prev = "abcdefghi"[i]
        levels.append(f"{name}: &{name} [" + ", ".join([f"*{prev}"] * 10) + "]")
    bomb = "\n".join(levels) + "\nmodifiers: []\n"  # 10**9 leaves in 1 KB
    assert "expands to more than 200,000 values" in _loads_quickly(bomb)
    assert "<string>:1:4: a value contains itself" in _loads_quickly("a: &a [1, *a]\nmodifiers: []")
    assert "nesting deeper than 64 levels" in _loads_quickly("x: " + "[" * 5000 + "]" * 5000)
    assert _loads_quickly("x: " + "[" * 5000 + "]" * 5000).startswith("<string>:1:")


@pytest.mark.parametrize("expr, words", [
    ("((((10**64)**64)**64)**64)**64", "beyond recal's limit of 2**63"),
    ("'x' * 10**10", "more than 10,000 items"),
    ("9**9**9", "exponent"),
    ("1e300 * 1e300", "not a finite number"),
])
def test_eval_cannot_build_huge_values(expr, words):
    text = f"n: eval({expr})\nmodifiers:\n- !EpochRangeModifier {{start_epoch: 0, end_epoch: 3}}\n"
    assert words in _loads_quickly(text)


def test_a_catastrophic_regex_is_cut_off_with_its_location():
    from recal_core.params import ParamInfo, resolve_params

    recipe = load_recipe("- !ConstantKSModifier {params: ['re:(a|aa)+$']}")
    params = [ParamInfo("a" * 60 + "b", "a" * 60, True)]
    started = time.perf_counter()
    with pytest.raises(RecipeError, match=r"<string>:1:\d+: .*field 'params': pattern 're:\(a\|aa\)\+\$' ran out of the recipe's 1 s"):
        resolve_params(recipe, 0, params, pruning=True)
    assert time.perf_counter() - started < HANG_SECONDS  # the 1 s budget's own words say it ran out


_RANGE = "\nmodifiers:\n- !EpochRangeModifier {start_epoch: 0, end_epoch: 3}\n"


@pytest.mark.parametrize("expr, words", [
    ("'%03000000000d' % 0", "a %-format width or precision of 3,000,000,000"),
    ("'%.3000000000f' % 1.5", "a %-format width or precision of 3,000,000,000"),
    ("'%*d' % (5, 1)", "a '*' width or precision"),
    ("+".join(["1"] * 150_000), "the expression is 299,999 characters long; expected at most 10,000"),
    ("+".join(["1"] * 4_000), "nested more than 100 operations deep"),
    ("-" * 9_000 + "1", "nested more than 100 operations deep"),
])
def test_eval_refuses_costly_operations_before_doing_them(expr, words):
    message = _loads_quickly(f"n: eval({expr}){_RANGE}", peak_bytes=64 << 20)  # a 3 GB string would show
    assert words in message and "recursive alias" not in message
    assert len(message) < 400, message  # the expression is shown shortened


def test_eval_work_is_one_budget_per_recipe_and_variables_resolve_in_linear_time():
    heavy = "".join(f"v{i}: eval('x' * 9999 + 'y')\n" for i in range(600))
    message = _loads_quickly(heavy + _RANGE)
    assert message.count("5,000,000 operations") == 1, message[:500]  # said once, where the budget ran out
    chain = "".join(f"v{i}: eval(v{i + 1} + 1)\n" for i in range(2_000)) + "v2000: 1\n"
    spent = []
    spend = ExpressionBudget.spend
    with mock.patch.object(ExpressionBudget, "spend", lambda self, units, source: (spent.append(units),
                                                                                  spend(self, units, source))[1]):
        recipe = load_recipe(chain + "modifiers:\n- !EpochRangeModifier {start_epoch: 0, end_epoch: eval(v0 - 1999)}\n")
    # each variable evaluated once: a few units a link, where resolving each from scratch would take millions
    assert recipe.max_epochs == 2 and sum(spent) < 10 * 2_000, sum(spent)


def test_patterns_are_bounded_at_load_and_timed_once_per_recipe():
    from recal_core.model_plan import plan_model
    from recal_core.params import ParamInfo

    for pattern in ("(?:a{1000}){1000}", "((?:a{100}){100}){100}", "a" * 1_001):
        message = _loads_quickly(f"- !ConstantKSModifier {{start_epoch: 0, end_epoch: 3, params: ['re:{pattern}']}}",
)
        assert "field 'params'" in message and ("unroll to" in message or "1,001 characters" in message), message
    slow = "p: &p ['re:(a|aa)+$']\nmodifiers:\n" + "- !ConstantKSModifier {start_epoch: 0, end_epoch: 3, params: *p}\n" * 20
    distinct = "modifiers:\n" + "".join(
        f"- !ConstantKSModifier {{start_epoch: 0, end_epoch: 3, params: ['re:(a|aa)+{i}$']}}\n" for i in range(20))
    params = [ParamInfo("a" * 60 + "b", "a" * 60, True)]
    for text in (slow, distinct):
        started = time.perf_counter()
        with pytest.raises(RecipeError, match="ran out of the recipe's 1 s"):
            plan_model(load_recipe(text).bind(10), params, {params[0].name: 10})
        # one 1 s budget for the recipe, not one per pattern (20 s): the margin is for a loaded 2-core machine
        assert time.perf_counter() - started < 5.0  # the budget is wall-clock, so load adds little


def test_what_a_recipe_expands_to_is_bounded():
    text = ("v: eval('re:' + 'x' * 990)\np: &p [" + ", ".join(["eval(v)"] * 3000) + "]\nmodifiers:\n"
            + "- !ConstantKSModifier {start_epoch: 0, end_epoch: 3, params: *p}\n" * 10)
    message = _loads_quickly(text, peak_bytes=12 << 20)  # expanded, the values would hold 30 M characters
    assert "exceed 2,000,000 characters" in message and message.count("exceed") == 1


def test_check_and_tf_tables_grow_with_the_recipe_not_its_epochs(tmp_path):
    recipe = tmp_path / "many.yaml"
    recipe.write_text("modifiers:\n" + "".join(
        f"- !GradualKSModifier {{start_epoch: 0, end_epoch: 100000, update_frequency: 1000, init_sparsity: 0.05, "
        f"final_sparsity: 0.8, params: [p{i}]}}\n" for i in range(400)))
    started = time.perf_counter()
    result = _cli("check", str(recipe))
    assert result.returncode == 0, result.stderr[-2000:]
    assert time.perf_counter() - started < HANG_SECONDS  # the table itself is milliseconds
    assert "201 of 100001 epochs shown" in result.stdout and len(result.stdout.splitlines()) < 700
    from recal_keras.recipe_support import check_table_size

    with pytest.raises(ValueError, match="800 per-step tables; recal_tf tabulates .* at most 10,000,000 steps and "
                                         "20,000,000 entries"):
        check_table_size(load_recipe(recipe).bind(1), "recal_tf")


def test_huge_epochs_and_huge_files_are_refused_before_they_cost(tmp_path):
    assert "less than or equal to 100000" in _loads_quickly("- !EpochRangeModifier {start_epoch: 0, end_epoch: 1e12}")
    big = tmp_path / "big.yaml"
    big.write_text("x: [" + "1, " * 1_000_000 + "1]\nmodifiers: []\n")
    started = time.perf_counter()
    with pytest.raises(RecipeError, match="big.yaml: the recipe file is .* bytes; expected a recipe of at most"):
        load_recipe(big)
    assert time.perf_counter() - started < 5  # a stat; parsing the file would take tens of seconds
    line = _one_line(_cli("check", str(ROOT / "recal_core/recipes/prune.yaml"), "--steps-per-epoch", "100000000000"))
    assert "at most 1,000,000,000 steps per epoch" in line


def test_check_plots_a_long_schedule_with_bounded_points(tmp_path):
    from recal_app.report import MAX_PLOT_POINTS, sample_steps

    schedule = load_recipe("- !EpochRangeModifier {start_epoch: 0, end_epoch: 100000}").bind(100_000)
    assert len(sample_steps(schedule)) <= 4 * MAX_PLOT_POINTS + 1


# --- silent nonsense ------------------------------------------------------------------------------


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


# --- not one line -----------------------------------------------------------------------------------


def _qdq_model(opset=17, domain=""):
    from tests.support.onnx_graphs import Builder

    b = Builder()
    y = b.node("Relu", [b.qdq("x", 0.1, 0)], domain=domain or None)
    model = b.model([("x", [1, 4])], [b.qdq(y, 0.1, 0)])
    model.opset_import[0].version = opset
    if domain:
        model.opset_import.append(onnx.helper.make_opsetid(domain, 1))
    return model


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


def test_a_ten_thousand_node_elementwise_chain_converts_in_bounded_time():
    """A hostile 10,000-node chain of elementwise ops between a DQ and a Q: one table, in linear time (the island's
    ordering searched the nodes left at every step: 176 s; now 6.6 s on this project's machine)."""
    import numpy as np

    from tests.support.onnx_graphs import Builder

    b = Builder()
    y = b.qdq("x", 0.03, 128)
    for _ in range(10_000):
        y = b.node("Add", [y, b.const(np.float32(1e-4))])
    model = b.model([("x", [1, 16])], [b.qdq(y, 0.05, 128)])
    started = time.perf_counter()
    result = quantize_qat_export(model)
    assert time.perf_counter() - started < 4 * HANG_SECONDS  # 4 s on a quiet machine; quadratic work would take hours
    assert [n.op_type for n in result.model.graph.node].count("Gather") == 1 and result.verification.max_steps == 0


def _converter_cases():
    """Inputs the converter once met with a raw exception or an invalid model: each built by name."""
    from onnx import TensorProto, helper

    from tests.support.onnx_graphs import Builder

    b = Builder()
    y = b.node("Max", [b.qdq("x", 0.1, 128), b.const(np.float32(np.nan))])
    yield "a NaN bound", b.model([("x", [None, 4])], [b.qdq(y, 0.1, 128)]), r"Max 'Max\d+' has a NaN bound"
    b = Builder()
    y = b.qdq(b.node("Relu", [b.qdq("x", 0.1, 128)]), 0.1, 128)
    sequence = b.node("SequenceConstruct", [y])
    model = b.model([("x", [None, 4])], [y])
    model.graph.output.append(helper.make_tensor_sequence_value_info(sequence, TensorProto.FLOAT, None))
    yield "a sequence output", model, r"output 'sequenceconstruct\d+' is a sequence, not a tensor"
    b = Builder()
    q = np.random.default_rng(0).integers(-7, 8, (8, 16)).astype(np.int8)
    w = b.node("DequantizeLinear", [b.const(q), b.const(np.full(8, 0.1, np.float32)), b.const(np.zeros(8, np.int8))],
               axis=0)
    y = b.node("Gemm", ["x", w, b.const(np.ones((8, 1), np.float32))], transB=1)
    yield "a bias that does not broadcast", b.model([("x", [4, 16])], [y]), \
        r"does not run in onnxruntime itself, as written: .*Gemm\d+.*bias"


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
