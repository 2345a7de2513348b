"""No input makes the loader or the converter raise anything but recal's errors, or take long
(hypothesis: >= 2,400 recipe texts, >= 150 mutated ONNX models), and the converter writes nothing
but its output."""

import random
import shutil
import time

import numpy as np
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
    assert {p.name for p in folder.iterdir()} <= {"in.onnx", "out.onnx", "out.x86-avx2.onnx"}


# --- round 3: eval operators, pattern sets, graph outputs of every kind behind broadcast constants ---------------

_ATOMS = ["1", "2.5", "-3", "n", "'ab'", "'%05d'", "'%*d'", "'%9999999d'", "[1, 2]", "10**9", "0"]
_BINARY = ["+", "-", "*", "/", "//", "%", "**"]
_CALLS = ["min", "max", "round", "int", "float", "abs"]


@st.composite
def _expressions(draw, depth=0):
    if depth > 3 or draw(st.integers(0, 2)) == 0:
        return draw(st.sampled_from(_ATOMS))
    kind = draw(st.integers(0, 3))
    if kind == 0:
        return f"({draw(_expressions(depth + 1))} {draw(st.sampled_from(_BINARY))} {draw(_expressions(depth + 1))})"
    if kind == 1:
        return f"-{draw(_expressions(depth + 1))}"
    if kind == 2:
        args = ", ".join(draw(st.lists(_expressions(depth + 1), min_size=1, max_size=3)))
        return f"{draw(st.sampled_from(_CALLS))}({args})"
    return f"{draw(st.sampled_from(_ATOMS))} * {draw(st.sampled_from(['10', '9999', '10**4', '2**62']))}"


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(_expressions(), min_size=1, max_size=6))
def test_eval_operators_in_any_combination_are_bounded(expressions):
    """Every operator, nested and chained through variables: a value or one located error, in bounded time."""
    lines = ["n: 3"] + [f"v{i}: eval({e}{f' + v{i - 1} * 0' if i else ''})" for i, e in enumerate(expressions)]
    _assert_only_recipe_errors("\n".join(lines) + "\nmodifiers:\n- !EpochRangeModifier {start_epoch: 0, end_epoch: 3}\n")


_PATTERN_TOKENS = ["a", "b", ".", "(", ")", "(?:", "+", "*", "?", "|", "{2}", "{100}", "{1000}", "{2,}", "[ab]", "$",
                   "\\.", "conv", "weight"]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.lists(st.sampled_from(_PATTERN_TOKENS), min_size=1, max_size=12), min_size=1, max_size=8),
       st.integers(1, 20))
def test_pattern_sets_take_one_budget_per_recipe(patterns, repeats):
    """Any set of re: patterns, each repeated through an alias: refused at load or matched within the recipe's
    one budget (plus the time one name takes), never more."""
    from recal_core.model_plan import plan_model
    from recal_core.params import ParamInfo
    from recal_core.patterns import PATTERN_SECONDS

    entries = ", ".join(repr("re:" + "".join(p)) for p in patterns)
    text = f"p: &p [{entries}]\nmodifiers:\n" + "".join(
        "- !ConstantKSModifier {start_epoch: 0, end_epoch: 3, params: *p}\n" for _ in range(repeats))
    started = time.perf_counter()
    try:
        recipe = load_recipe(text)
    except RecipeError:
        assert time.perf_counter() - started < RECIPE_SECONDS
        return
    names = ["a" * 40 + "b", "conv1.weight", "ab" * 20, "layer.0.conv.weight"]
    params = [ParamInfo(n, n.rsplit(".", 1)[0], True) for n in names]
    started = time.perf_counter()
    try:
        plan_model(recipe.bind(2), params, {n: 8 for n in names})
    except RecipeError as err:
        assert "internal error" not in str(err)
    assert time.perf_counter() - started < PATTERN_SECONDS + 1.0


_SHAPES = [(6,), (1, 6), (1, 6, 1), (1, 6, 1, 1), (6, 1, 1), (1, 1, 1, 6), (1, 1, 6, 1), (1, 1, 6, 6), (6, 6, 6), ()]
"""Constants that broadcast against a [N, 6, 6, 6] conv output: per channel only where axis 1 alone is 6."""


@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])  # files named per case
@given(st.sampled_from(_SHAPES), st.sampled_from(_SHAPES + [None]), st.sampled_from(["integer", "class ids", "float"]),
       st.integers(0, 2**16))
def test_no_wrong_model_is_verified_whatever_the_broadcast_and_the_output(tmp_path, mul_shape, add_shape, kind, seed):
    """Conv -> Mul / Add by constants of any shape that broadcasts -> an integer, class-id or float output: the
    converter writes a model only if onnxruntime's run of it agrees with the QDQ model, checked here again."""
    from recal_onnx import ModelError, VerificationError, quantize_qat_export

    from .onnx_graphs import Builder, reference, run

    b = Builder(seed=seed)
    y = b.node("Conv", [b.qdq("x", 0.02, 128), b.weight((6, 3, 1, 1))], pads=[0, 0, 0, 0])
    y = b.node("Mul", [y, b.const((b.rng.uniform(0.5, 2.0, mul_shape)).astype(np.float32))])
    if add_shape is not None:
        y = b.node("Add", [y, b.const((b.rng.standard_normal(add_shape) * 0.1).astype(np.float32))])
    s, z = b.const(np.float32(0.03)), b.const(np.uint8(128))
    q = b.node("QuantizeLinear", [y, s, z])
    out = q if kind == "integer" else b.node("DequantizeLinear", [q, s, z])
    if kind == "class ids":
        out = b.node("ArgMax", [b.node("Flatten", [b.node("GlobalAveragePool", [out])])], axis=1, keepdims=0)
    model = b.model([("x", [None, 3, 6, 6])], [out])
    model.graph.output[0].type.tensor_type.elem_type = {"integer": 2, "class ids": 7}.get(kind, 1)
    feeds = {"x": np.random.default_rng(seed).standard_normal((32, 3, 6, 6)).astype(np.float32)}
    target = tmp_path / f"fuzz-{seed}.int8.onnx"
    target.unlink(missing_ok=True)  # hypothesis may draw a seed twice
    try:
        quantize_qat_export(model, target, inputs=feeds)
    except (ModelError, VerificationError):
        assert not target.exists()
        return
    import onnx

    (want,), (got,) = reference(model, feeds), run(onnx.load(target), feeds)
    if kind == "integer":
        assert np.abs(want.astype(int) - got.astype(int)).max() <= 3
    elif kind == "class ids":
        assert np.mean(want == got) >= 0.95
    else:
        assert np.abs(want - got).max() <= 0.1 * max(float(np.ptp(want)), 1e-6) + 3 * 0.03


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from([1e-3, 1.0, 1e6, 1e12, float("inf")]), st.integers(0, 5), st.booleans())
def test_training_that_goes_non_finite_keeps_pruned_weights_zero_and_is_stopped(lr, poison_step, momentum):
    """Any LR (up to inf), NaN injected into the weights at any step: every weight a mask prunes is exactly 0
    after every step (masks are applied with where, not a product: NaN x 0 is NaN), and the trainers' check
    stops the run at the first step whose loss or weights are not finite."""
    import torch

    from recal_app.training import Diverged, check_finite
    from recal_torch import ScheduledModifierManager

    from .torch_models import SmallCNN, batches

    torch.manual_seed(0)
    model = SmallCNN()
    manager = ScheduledModifierManager.from_yaml(
        "- !GradualKSModifier {params: __ALL_PRUNABLE__, init_sparsity: 0.3, final_sparsity: 0.6, start_epoch: 0, "
        "end_epoch: 2, update_frequency: 1}\n- !SetLearningRateModifier {learning_rate: %r, start_epoch: 0}\n"
        % min(lr, 1e30))
    optimizer = manager.modify(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9 if momentum else 0),
                               steps_per_epoch=3)
    stopped = None
    for step, (x, y) in enumerate(batches(6), 1):
        if step - 1 == poison_step:
            with torch.no_grad():
                model.conv1.weight[0, 0, 0, 0] = float("nan")
        loss = torch.nn.functional.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        for name, per_modifier in manager.masks.masks.items():
            weight = dict(model.named_parameters())[name]
            for mask in per_modifier.values():
                assert torch.all(weight.detach()[mask == 0] == 0), (name, step)
        try:
            check_finite("torch", step, float(loss.detach()), [p.detach().numpy() for p in model.parameters()])
        except Diverged as exc:
            stopped = step
            assert f"diverged at step {step}" in str(exc)
            break
    poisoned = any(not torch.isfinite(p).all() for p in model.parameters())
    assert stopped is not None or not poisoned
