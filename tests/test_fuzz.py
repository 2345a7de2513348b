"""No input makes the loader or the converter raise anything but recal's errors, or take long
(hypothesis: >= 2,400 recipe texts, >= 150 mutated ONNX models), and the converter writes nothing
but its output."""

import random
import shutil
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from recal_core import RecipeError, load_recipe

from .conftest import RECIPES

VALID_TEXTS = [p.read_text() for p in sorted(RECIPES.glob("*.yaml"))]
YAML_TOKENS = ["- ", ": ", "!GradualKSModifier", "!Foo", "!!python/object:os.system", "&a ", "*a", "{", "}",
               "[", "]", "eval(", ")", "---", "\n", "  ", "__ALL__", "re:(", "-1", "1e9", ".nan", "null",
               "'", '"', "#", "|", ">", "?", "%YAML 1.1\n", "<<: *a", "\t", "\x00", "modifiers", "version"]


RECIPE_SECONDS = 2.0  # the bound on one load, far above what a valid recipe takes (milliseconds)


def _assert_only_recipe_errors(text: str) -> None:
    started = time.perf_counter()
    try:
        load_recipe(text)
    except RecipeError as err:
        assert "internal error" not in str(err), str(err)
        assert err.problems
    assert time.perf_counter() - started < RECIPE_SECONDS


@settings(max_examples=800, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.text(max_size=300))
def test_arbitrary_text(text):
    _assert_only_recipe_errors(text)


@settings(max_examples=800, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.sampled_from(YAML_TOKENS + ["a", "0", "0.5", "x"]), max_size=40))
def test_yaml_shaped_garbage(tokens):
    _assert_only_recipe_errors("".join(tokens))


@pytest.mark.filterwarnings("ignore::recal_core.errors.RecipeWarning")  # a mutation may drop a warned default
@settings(max_examples=800, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, len(VALID_TEXTS) - 1), st.integers(0, 2**32 - 1), st.integers(1, 6))
def test_mutated_valid_recipes(which, seed, edits):
    rng = random.Random(seed)
    text = list(VALID_TEXTS[which])
    for _ in range(edits):
        op = rng.randrange(4)
        pos = rng.randrange(len(text) + 1)
        if op == 0 and text:  # delete a span
            del text[pos: pos + rng.randrange(1, 12)]
        elif op == 1:  # insert a token
            text[pos:pos] = list(rng.choice(YAML_TOKENS))
        elif op == 2 and text:  # swap a character
            text[min(pos, len(text) - 1)] = rng.choice("0123456789.-:!&*[]{}\n x")
        else:  # duplicate a line
            lines = "".join(text).splitlines(keepends=True)
            if lines:
                i = rng.randrange(len(lines))
                lines.insert(i, lines[i])
                text = list("".join(lines))
    _assert_only_recipe_errors("".join(text))


# --- ONNX inputs ----------------------------------------------------------------------------------

CONVERT_SECONDS = 30.0


@pytest.fixture(scope="module")
def qat_bytes(tmp_path_factory):
    import torch

    from recal_torch import export_onnx

    from .torch_models import qat_small_cnn

    path = export_onnx(qat_small_cnn(), torch.randn(1, 1, 8, 8), tmp_path_factory.mktemp("qat") / "qat.onnx",
                       dynamo=False)
    return path.read_bytes()


def _mutate(data: bytes, rng: random.Random) -> bytes:
    import onnx

    kind = rng.randrange(7)
    if kind == 0:  # flip bytes
        raw = bytearray(data)
        for _ in range(rng.randrange(1, 20)):
            raw[rng.randrange(len(raw))] = rng.randrange(256)
        return bytes(raw)
    if kind == 1:  # truncate
        return data[: rng.randrange(len(data))]
    model = onnx.load_from_string(data)
    nodes, inits = model.graph.node, model.graph.initializer
    if kind == 2:
        model.opset_import[0].version = rng.choice([1, 9, 10, 13, 17, 21, 26, 99, 10**6])
    elif kind == 3:  # an op renamed or moved to another domain
        node = nodes[rng.randrange(len(nodes))]
        node.op_type = rng.choice(["Conv", "QLinearConv", "Add", "Foo", "DequantizeLinear", "Gemm", ""])
        node.domain = rng.choice(["", "", "com.microsoft", "x.y"])
    elif kind == 4:  # an initializer's shape or type changed
        init = inits[rng.randrange(len(inits))]
        if rng.random() < 0.5 and init.dims:
            init.dims[rng.randrange(len(init.dims))] = rng.choice([0, 1, 3, 10**6])
        else:
            init.data_type = rng.choice([onnx.TensorProto.INT8, onnx.TensorProto.UINT8, onnx.TensorProto.FLOAT16,
                                         onnx.TensorProto.INT64, onnx.TensorProto.STRING])
    elif kind == 5:  # an input rewired
        node = nodes[rng.randrange(len(nodes))]
        if node.input:
            node.input[rng.randrange(len(node.input))] = rng.choice(["", "nothing", nodes[0].output[0], "input"])
    else:  # a node dropped or duplicated
        i = rng.randrange(len(nodes))
        if rng.random() < 0.5:
            del nodes[i]
        else:
            nodes.append(nodes[i])
    return model.SerializeToString()


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(st.integers(0, 2**32 - 1), st.integers(1, 3))
def test_mutated_onnx_models(qat_bytes, tmp_path, seed, rounds):
    import warnings

    from recal_onnx import ModelError, UnconvertedOpsWarning, VerificationError, quantize_qat_export

    rng = random.Random(seed)
    data = qat_bytes
    for _ in range(rounds):
        try:
            data = _mutate(data, rng)
        except Exception:  # noqa: BLE001 - a mutation that onnx itself cannot parse again: keep the bytes
            break
    folder = tmp_path / f"case-{seed}-{rounds}"
    shutil.rmtree(folder, ignore_errors=True)  # hypothesis replays a failing case: start it afresh
    folder.mkdir()
    src = folder / "in.onnx"
    src.write_bytes(data)
    started = time.perf_counter()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UnconvertedOpsWarning)
            quantize_qat_export(src, folder / "out.onnx")
    except (ModelError, VerificationError):
        pass
    assert time.perf_counter() - started < CONVERT_SECONDS
    assert src.read_bytes() == data  # the input is untouched
    assert {p.name for p in folder.iterdir()} <= {"in.onnx", "out.onnx"}
