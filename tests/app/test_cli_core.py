"""`recal check` and `recal schema`; the core imports no framework."""

import json
import subprocess
import sys

import pytest

from recal_core import load_recipe, recipe_json_schema
from recal_app.cli import main

from tests.support.paths import RECIPES


def test_check_prints_the_seed_table(capsys):
    assert main(["check", str(RECIPES / "seed_prune_all.yaml")]) == 0
    out = capsys.readouterr().out
    lines = {line.split()[0]: line.split() for line in out.splitlines() if line.strip()[:1].isdigit()}
    assert lines["4"][2] == "-"  # not pruning yet
    assert lines["5"][2] == "0.0500"  # init_sparsity at start_epoch
    # cubic: 0.05 + 0.75 * (1 - (1 - 1/15)^3) at epoch 6
    assert lines["6"][2] == f"{0.05 + 0.75 * (1 - (14 / 15) ** 3):.4f}"
    assert lines["20"][2] == lines["25"][2] == "0.8000"
    assert "max_epochs=25" in out


def test_check_with_steps_and_plot(tmp_path, capsys):
    out_png = tmp_path / "curves.png"
    assert main(["check", str(RECIPES / "prune_quant.yaml"), "--steps-per-epoch", "8", "--plot", str(out_png)]) == 0
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [p.name for p in tmp_path.iterdir()] == ["curves.png"]  # no temp files left
    out = capsys.readouterr().out
    assert "on (bn-frozen, obs-frozen)" in out and "0.005" in out


@pytest.mark.parametrize("argv, message", [
    (["check", "missing.yaml"], "recipe file not found"),
    (["check", "recal:seed_prune_all", "--plot", "/nonexistent-dir/x.png"], "does not exist"),
])
def test_check_errors_are_one_line(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1


def test_check_invalid_recipe_lists_problems(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("- !EpochRangeModifier {start_epoch: 3, end_epoch: 1}\n- !Nope {}\n")
    assert main(["check", str(bad)]) == 2
    err = capsys.readouterr().err
    assert f"{bad}:1:" in err and f"{bad}:2:" in err


def test_console_script_runs():
    exe = [sys.executable, "-m", "recal_app.cli", "check", str(RECIPES / "seed_lr_schedule.yaml")]
    out = subprocess.run(exe, capture_output=True, text=True, check=True).stdout
    assert "0.09" in out  # 0.1 * 0.9 after the first milestone (5.5 -> step 6)


def test_schema_is_json_and_validates_shipped_recipes(tmp_path):
    jsonschema = pytest.importorskip("jsonschema")
    out = tmp_path / "schema.json"
    assert main(["schema", "-o", str(out)]) == 0
    schema = json.loads(out.read_text())
    assert schema == json.loads(json.dumps(recipe_json_schema()))
    validator = jsonschema.Draft202012Validator(schema)
    for path in RECIPES.glob("*.yaml"):
        r = load_recipe(path)
        doc = {"version": r.version,
               "modifiers": [m.model_dump(mode="json", exclude_defaults=True) for m in r.modifiers]}
        validator.validate(doc)
    with pytest.raises(jsonschema.ValidationError):
        validator.validate({"modifiers": [{"start_epoch": "x"}]})


def test_core_imports_no_framework():
    code = ("import sys, recal_core, recal_app.cli, recal_app.report; "
            "bad = [m for m in ('torch', 'tensorflow', 'onnx', 'onnxruntime', 'matplotlib') if m in sys.modules]; "
            "print(bad); sys.exit(1 if bad else 0)")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_libraries_know_nothing_of_the_application():
    """recal_app (recal train and the command line) is built on the libraries; no library imports it, and no backend
    imports another backend but for the one edge the layout names: the TensorFlow graph front end runs recal_keras's
    tables and grids with TensorFlow's ops (as Keras does on its TensorFlow backend)."""
    import ast

    from tests.support.paths import ROOT

    backends = {"recal_torch", "recal_keras", "recal_tf", "recal_onnx"}
    allowed = {"recal_tf": {"recal_keras"}}
    for package in ("recal_core", *sorted(backends)):
        for path in (ROOT / package).rglob("*.py"):
            tree = ast.parse(path.read_text())
            imported = {(n.module if isinstance(n, ast.ImportFrom) else a.name).split(".")[0]
                        for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))
                        and (not isinstance(n, ast.ImportFrom) or (n.level == 0 and n.module))
                        for a in (n.names if isinstance(n, ast.Import) else [None])}
            assert "recal_app" not in imported, path
            assert not (imported & (backends - {package} - allowed.get(package, set()))), (path, imported & backends)


def test_no_module_is_over_400_lines_and_no_import_cycle():
    """One file per concept, small enough to read; the modules of each package import each other without cycles."""
    import ast

    from tests.support.paths import ROOT

    graph: dict[str, set[str]] = {}
    for package in ("recal_core", "recal_torch", "recal_keras", "recal_tf", "recal_onnx", "recal_app"):
        for path in (ROOT / package).rglob("*.py"):
            text = path.read_text()
            assert text.count("\n") <= 400, f"{path.relative_to(ROOT)} has {text.count(chr(10))} lines"
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
            parent = name if path.name == "__init__.py" else name.rpartition(".")[0]
            edges = set()
            for node in ast.walk(ast.parse(text)):
                if isinstance(node, ast.ImportFrom) and node.level:  # relative: within the package
                    base = parent.rsplit(".", node.level - 1)[0] if node.level > 1 else parent
                    target = f"{base}.{node.module}" if node.module else base
                    edges.update({target} if node.module else {f"{base}.{a.name}" for a in node.names})
                elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("recal_"):
                    edges.add(node.module)
            graph[name] = edges
    graph = {name: {e for e in edges if e in graph} for name, edges in graph.items()}
    state: dict[str, int] = {}

    def visit(name, path):
        state[name] = 1
        for nxt in sorted(graph[name]):
            if state.get(nxt) == 1 and not name.startswith(nxt + ".") and nxt != name.rpartition(".")[0]:
                raise AssertionError(f"import cycle: {' -> '.join(path + [nxt])}")
            if nxt not in state:
                visit(nxt, path + [nxt])
        state[name] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])


def test_every_python_file_compiles_without_a_warning():
    """An invalid escape in a docstring is a SyntaxWarning today and an error in a later Python."""
    import subprocess
    import warnings

    from tests.support.paths import ROOT

    files = subprocess.run(["git", "ls-files", "*.py"], cwd=ROOT, capture_output=True, text=True).stdout.split()
    assert files
    for name in files:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            compile((ROOT / name).read_text(), name, "exec")


def test_a_subpackage_is_entered_through_its_init():
    """A package's modules are its own: code outside ``recal_torch.qat`` (or any subpackage) imports the names the
    package's ``__init__`` gives, never one of its modules, so a package can rearrange its rooms without a caller
    noticing."""
    import ast

    from tests.support.paths import ROOT

    packages = {".".join(p.parent.relative_to(ROOT).parts) for lib in ("recal_core", "recal_torch", "recal_keras",
                "recal_tf", "recal_onnx", "recal_app") for p in (ROOT / lib).rglob("__init__.py")}
    declared = {("recal_onnx.pipeline", "recal_onnx.passes")}  # the pipeline names each pass, in the order they run
    reached = []
    for lib in ("recal_core", "recal_torch", "recal_keras", "recal_tf", "recal_onnx", "recal_app"):
        for path in (ROOT / lib).rglob("*.py"):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
            here = name if path.name == "__init__.py" else name.rpartition(".")[0]
            for node in ast.walk(ast.parse(path.read_text())):
                if not isinstance(node, ast.ImportFrom):
                    continue
                base = here.rsplit(".", node.level - 1)[0] if node.level > 1 else here
                module = (f"{base}.{node.module}" if node.module else base) if node.level else node.module
                if not module or not module.startswith("recal_"):
                    continue
                targets = [module] if node.module else [f"{module}.{a.name}" for a in node.names]
                for target in targets:
                    owner = target if target in packages else target.rpartition(".")[0]
                    if (owner.count(".") and owner != target and not (here + ".").startswith(owner + ".")
                            and (name, owner) not in declared):
                        reached.append(f"{path.relative_to(ROOT)} imports {target}, inside {owner}")
    assert not reached, "\n".join(reached)


def test_the_digits_read_from_scikit_learns_csv_are_its_load_digits():
    """recal reads scikit-learn's bundled CSV without importing scikit-learn: the same images, labels and split."""
    import numpy as np
    from sklearn.datasets import load_digits as sklearn_digits

    from recal_core.datasets import SPLIT_SEED, TEST_SIZE, load_digits

    digits, reference = load_digits(), sklearn_digits()
    order = np.random.default_rng(SPLIT_SEED).permutation(len(reference.target))
    images = np.concatenate([digits.test_images, digits.train_images])
    labels = np.concatenate([digits.test_labels, digits.train_labels])
    assert images.dtype == np.float32 and labels.dtype == np.int64 and len(digits.test_labels) == TEST_SIZE
    np.testing.assert_array_equal(images, (reference.images / 16.0).astype(np.float32)[order])
    np.testing.assert_array_equal(labels, reference.target[order])


def test_the_digits_come_from_scikit_learns_loader_when_its_csv_is_elsewhere(monkeypatch, tmp_path):
    """A scikit-learn that keeps its data in another place: its own loader, the same digits."""
    import importlib.util

    import numpy as np

    from recal_core import datasets

    expected = datasets.load_digits()
    spec = importlib.util.find_spec("sklearn")
    moved = importlib.util.spec_from_file_location("sklearn", tmp_path / "sklearn" / "__init__.py")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: moved if name == "sklearn" else spec)
    got = datasets.load_digits()
    for field in ("train_images", "train_labels", "test_images", "test_labels"):
        np.testing.assert_array_equal(getattr(got, field), getattr(expected, field))


def test_the_cli_says_its_version_and_helps_with_every_option(capsys):
    """``recal --version`` names the installed version; every option of every command has help text; ``train`` names
    all three front ends."""
    import argparse
    from importlib.metadata import version

    from recal_app.cli import build_parser

    parser = build_parser()
    with pytest.raises(SystemExit) as done:
        parser.parse_args(["--version"])
    assert done.value.code == 0 and capsys.readouterr().out.strip() == f"recal {version('recal')}"
    missing = []

    def walk(p, name):
        for action in p._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub, child in action.choices.items():
                    walk(child, sub)
            elif action.help is None:
                missing.append((name, action.option_strings or action.dest))

    walk(parser, "recal")
    assert not missing, missing
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    assert "Keras" in parser.format_help()
    assert "Keras" in next(c.help for c in commands._choices_actions if c.dest == "train")
