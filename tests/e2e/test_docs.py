"""The manual cannot drift: its tables equal what the saved JSON gives, it builds without a warning, the README stays
short, and every public function documents its arguments."""

import importlib
import inspect
import subprocess
import sys

import pytest

from tests.support.paths import ROOT

import render_docs

PUBLIC = ["recal_core", "recal_torch", "recal_onnx", "recal_tf", "recal_tf.graph", "recal_keras", "recal_app"]


def test_generated_tables_and_index_equal_what_the_json_gives():
    stale = [path.name for path, text in render_docs.outputs().items() if path.read_text() != text]
    assert not stale, f"run python scripts/render_docs.py: {stale}"


def test_generated_text_has_no_unfilled_placeholder():
    """A note written as a plain string beside f-strings keeps its ``{data[...]}`` as text: caught here."""
    import re

    for path, text in render_docs.outputs().items():
        left = re.findall(r"\{(?:data|r|row|rows|dense|rtn)\[[^}]*\}[^ ]*", text)
        assert not left, f"{path.name}: {left[:3]}"


def test_every_table_marker_names_a_table_and_every_json_is_used():
    pages = [ROOT / "README.md", *(ROOT / "docs").glob("*.md")]
    names = {m.group("name") for page in pages for m in render_docs.MARKER.finditer(page.read_text())}
    assert names == set(render_docs.TABLES)
    from bench.results import RESULTS

    assert {p.name for p in RESULTS.glob("*.json")} == {
        "avx2_exactness.json", "demo.json", "digits_int8.json", "export.json", "gpu_check.json", "interop.json",
        "jax_compile.json", "keras_applications.json", "keras_backends.json", "large_decoder.json", "layer_latency.json",
        "learned_scales.json", "llm.json", "llm_ternary.json", "llm_ternary_h128.json", "llm_ternary_h96.json",
        "lsq_overhead.json", "plan.json", "plan_cnn.json", "plan_cnn_mobilenet.json", "plan_time.json",
        "real_model_qat.json", "real_models.json", "reduce_range.json",
        "thinning_transformers.json", "transformers.json", "zoo.json", "zoo_vnni.json", "zoo_vnni_amd.json"}


def test_readme_is_short_and_links_only_pages_that_exist():
    text = (ROOT / "README.md").read_text()
    assert len(text) < 12_000
    for target in set(__import__("re").findall(r"\]\((docs/[\w.-]+\.md)", text)):
        assert (ROOT / target).is_file(), target


@pytest.mark.slow
def test_the_manual_builds_strict(tmp_path):
    result = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)],
                            cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "WARNING" not in result.stderr, result.stderr[-3000:]
    api = (tmp_path / "api" / "index.html").read_text()
    assert "quantize_qat_export" in api and "choose_weights" in api


def test_public_faces_declare_what_is_public_and_internal_rooms_do_not():
    """The public API is each public package's ``__all__`` (the API reference documents exactly that); an internal
    room (``recal_torch.qat``, ``recal_onnx.passes``, ...) declares none, so the line is in the tree. Every name
    declared exists, and every module says what it is for."""
    import pkgutil

    faces = {*PUBLIC, "recal_torch.integrations"}
    for top in ("recal_core", "recal_torch", "recal_onnx", "recal_keras", "recal_tf", "recal_app"):
        package = importlib.import_module(top)
        for info in [None, *pkgutil.walk_packages(package.__path__, top + ".")]:
            name = top if info is None else info.name
            if name.endswith(".__main__"):
                continue
            module = importlib.import_module(name)
            assert (module.__doc__ or "").strip(), f"{name} has no docstring"
            if info is not None and not info.ispkg:
                continue
            if name in faces:
                assert hasattr(module, "__all__"), f"public package {name} declares no __all__"
                assert all(hasattr(module, n) for n in module.__all__), name
            else:
                assert not hasattr(module, "__all__"), f"{name} is an internal room but declares __all__"


def _public_functions():
    """Every function a public package exports, and every public method its exported classes define."""
    seen = set()
    for package in PUBLIC:
        module = importlib.import_module(package)
        for name in module.__all__:
            value = getattr(module, name)
            if inspect.isfunction(value) and value not in seen:
                seen.add(value)
                yield f"{package}.{name}", value
            elif inspect.isclass(value) and value.__module__.startswith("recal_"):
                for attr, member in vars(value).items():
                    if isinstance(member, (classmethod, staticmethod)):
                        member = member.__func__
                    if attr.startswith("_") or not inspect.isfunction(member) or member in seen:
                        continue
                    seen.add(member)
                    yield f"{package}.{name}.{attr}", member


@pytest.mark.parametrize("name, function", list(_public_functions()), ids=lambda x: x if isinstance(x, str) else "")
def test_public_functions_document_their_arguments(name, function):
    doc = inspect.getdoc(function) or ""
    params = [p for p in inspect.signature(function).parameters if p not in ("self", "cls")]
    assert doc, f"{name} has no docstring"
    if params:
        assert "Args:" in doc, f"{name}: no Args section"
        section = doc.split("Args:", 1)[1]
        missing = [p for p in params if f"{p}:" not in section and f"{p} (" not in section]
        assert not missing, f"{name}: arguments not documented: {missing}"


# the seed document's helper modules: public as modules (its examples import from them)
PUBLIC_MODULES = {"recal_tf.models", "recal_tf.utils", "recal_tf.input_data"}


def test_docs_examples_and_scripts_import_only_the_public_api():
    """What the README, the docs' examples and scripts/ import of recal is what a user may: a package's ``__all__``,
    or one of the seed's helper modules. A name they need is made public, not reached for inside a package."""
    import ast

    from docs_examples import python_blocks

    sources = [*python_blocks(), *((str(p.relative_to(ROOT)), p.read_text()) for p in (ROOT / "scripts").rglob("*.py"))]
    reached = []
    for where, code in sources:
        for node in ast.walk(ast.parse(code)):
            if isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").startswith("recal_"):
                if node.module in PUBLIC_MODULES:
                    continue
                module = importlib.import_module(node.module)
                public = set(getattr(module, "__all__", ())) if hasattr(module, "__path__") else set()
                reached += [f"{where}: from {node.module} import {a.name}" for a in node.names
                            if a.name not in public and f"{node.module}.{a.name}" not in PUBLIC_MODULES]
            elif isinstance(node, ast.Import):
                reached += [f"{where}: import {a.name}" for a in node.names if a.name.startswith("recal_")
                            and a.name not in PUBLIC_MODULES and not hasattr(importlib.import_module(a.name), "__path__")]
    assert not reached, "\n".join(reached)
