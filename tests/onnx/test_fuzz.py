"""No input makes the loader or the converter raise anything but recal's errors, or take long
(hypothesis: >= 2,400 recipe texts, >= 150 mutated ONNX models), and the converter writes nothing
but its output."""

import random
import shutil
import time
import warnings
from pathlib import Path

import numpy as np
import onnx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from recal_core import RecipeError, load_recipe

from tests.support.paths import RECIPES
from tests.support.hang_guard import HANG_SECONDS

VALID_TEXTS = [p.read_text() for p in sorted(RECIPES.glob("*.yaml"))]
YAML_TOKENS = ["- ", ": ", "!GradualKSModifier", "!Foo", "!!python/object:os.system", "&a ", "*a", "{", "}",
               "[", "]", "eval(", ")", "---", "\n", "  ", "__ALL__", "re:(", "-1", "1e9", ".nan", "null",
               "'", '"', "#", "|", ">", "?", "%YAML 1.1\n", "<<: *a", "\t", "\x00", "modifiers", "version"]


RECIPE_SECONDS = HANG_SECONDS  # one load: milliseconds for a valid recipe; a blow-up would take minutes


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

CONVERT_SECONDS = HANG_SECONDS


@pytest.fixture(scope="module")
def qat_bytes(tmp_path_factory):
    import torch

    from recal_torch import export_onnx

    from tests.support.torch_models import qat_small_cnn

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


def _case_folder(tmp_path, name: str):
    """A fresh folder for one case (hypothesis replays a failing case: it starts afresh)."""
    folder = tmp_path / name
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir()
    return folder


def _converts_or_is_refused(source, folder, kept: set[str], named: bool = True, ignore=(), **options):
    """``quantize_qat_export(source, folder / "out.onnx", **options)`` converts (verified) or is refused with a
    ModelError or VerificationError (with ``named``, a reason rather than a crash it wraps), in bounded time, and
    ``folder`` holds nothing but ``kept`` and whole outputs after; ``ignore``: the warning categories let pass.
    Returns the conversion's result, None where it was refused."""
    from recal_onnx import ModelError, UnconvertedOpsWarning, VerificationError, quantize_qat_export

    # this process's CPU time (onnxruntime's threads included): what the conversion itself spent. Wall time on a
    # shared 2-core machine stretches when another worker's launched processes hold the cores: refusals that take
    # 0.0 s alone measured 49 s and 60 s of wall time in fresh-clone CI runs
    started = time.process_time()
    result = None
    try:
        with warnings.catch_warnings():
            for category in (UnconvertedOpsWarning, *ignore):
                warnings.simplefilter("ignore", category)
            result = quantize_qat_export(source, folder / "out.onnx", **options)
    except (ModelError, VerificationError) as exc:
        assert not named or "cannot convert" not in str(exc), exc
    assert time.process_time() - started < CONVERT_SECONDS
    assert {p.name for p in folder.iterdir()} <= {*kept, "out.onnx", "out.x86-avx2.onnx"}
    return result


def _computes_the_definition(result, definition, shape, seed: int, reading=None) -> None:
    """A converted model computes what the format defines (``definition(feeds)``: QONNX's ``Quant`` or AIMET's
    simulation, written in the tests apart from the converter) on 4 samples: at most 5% of the values differ (a
    rounding tie carried on: 2 of a classifier's 40 logits), none by more than 5% of the output's range; a
    misreading (a sign, a scale) is far beyond. Given the QDQ ``reading`` the converter started from, a value that
    differs as onnxruntime's own default session of that reading differs is onnxruntime's rounding (its fused integer
    kernels requantize in float32: a step off the definition at about 1% of a QONNX ResNet's logits) and is not
    counted; the reading itself, simulated in float, is held to the same 5% of range at every value (not to the
    count: float32 convolutions summed in another order tip a tie upstream, which moves most of one sample's
    quantized logits by a step, 6 of 10 for seed 1540)."""
    import onnxruntime as ort

    from tests.support.onnx_graphs import run

    name = result.model.graph.input[0].name
    gaps, own, read_gaps = [], [], []
    for sample in range(4 // shape[0]):  # a fixed batch of 1: four runs
        feeds = {name: np.random.default_rng([seed, sample]).standard_normal(shape).astype(np.float32)}
        want, got = definition(feeds)[0].astype(np.float64), run(result.model, feeds)[0].astype(np.float64)
        span = max(float(want.max() - want.min()), 1e-12)
        gap = np.abs(want - got).ravel() / span
        gaps.append(gap)
        if reading is None:
            own.append(gap > 1e-6)
            continue
        simulated = run(reading, feeds, level=ort.GraphOptimizationLevel.ORT_DISABLE_ALL)[0]
        read_gaps.append(np.abs(want - simulated).ravel() / span)
        as_onnxruntime = np.abs(run(reading, feeds)[0] - got).ravel() / span <= 1e-6
        own.append((gap > 1e-6) & ~as_onnxruntime)  # off the definition, and not as onnxruntime is
    gap, own = np.concatenate(gaps), np.concatenate(own)
    # a float bias the integer kernel cannot hold (a mutated weight scale or bias width) is rounded onto its int32
    # grid, named in result.rounded_biases: a step off at many outputs is that named rounding (hypothesis seed 2586:
    # 14 of 40 logits, one step each, at a bias 0.43 int32 steps off), held to the magnitude bound only
    counted = 0 if result.rounded_biases else np.count_nonzero(own)
    assert counted <= 0.05 * gap.size and gap.max() <= 0.05, (gap.max(), np.mean(own), result.rounded_biases)
    if read_gaps:
        assert np.concatenate(read_gaps).max() <= 0.05, "the QDQ reading is off the definition"


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(st.integers(0, 2**32 - 1), st.integers(1, 3))
def test_mutated_onnx_models(qat_bytes, tmp_path, seed, rounds):
    rng = random.Random(seed)
    data = qat_bytes
    for _ in range(rounds):
        try:
            data = _mutate(data, rng)
        except Exception:  # noqa: BLE001 - a mutation that onnx itself cannot parse again: keep the bytes
            break
    folder = _case_folder(tmp_path, f"case-{seed}-{rounds}")
    src = folder / "in.onnx"
    src.write_bytes(data)
    _converts_or_is_refused(src, folder, {"in.onnx"}, named=False)
    assert src.read_bytes() == data  # the input is untouched


_QONNX = Path(__file__).parents[1] / "fixtures" / "interop" / "brevitas-qonnx-small-resnet.onnx"
_QONNX_VALUES = [0.0, -1.0, 0.5, 1.0, 1.5, 2.0, 7.5, 8.0, 9.0, 16.0, 33.0, 300.0, 1e-30, 1e30, 1e9, float("nan"),
                 float("inf")]


def _mutate_qonnx(model, rng: random.Random) -> None:
    """One of a QONNX Quant's attributes or constant inputs (scale, zero point, bit width) changed."""
    quants = [n for n in model.graph.node if n.op_type == "Quant"]
    node = quants[rng.randrange(len(quants))]
    if rng.random() < 0.4:
        name = rng.choice(["narrow", "signed", "rounding_mode"])
        kept = [a for a in node.attribute if a.name != name]
        del node.attribute[:]
        node.attribute.extend(kept)
        if rng.random() < 0.8:
            value = rng.choice(["ROUND", "FLOOR", "HALF_UP", "ODD", ""]) if name == "rounding_mode" else rng.choice(
                [0, 1, 2, -1])
            node.attribute.append(onnx.helper.make_attribute(name, value))
        return
    target = node.input[rng.randrange(1, 4)]
    init = next(t for t in model.graph.initializer if t.name == target)
    shape = rng.choice([list(init.dims), [1], [3], [16, 1, 1, 1], [1, 16, 1, 1], [2, 16, 1, 1]])
    value = np.full(shape, rng.choice(_QONNX_VALUES), np.float32)
    init.CopyFrom(onnx.numpy_helper.from_array(value, target))


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
@given(st.integers(0, 2**32 - 1), st.integers(1, 3))
def test_mutated_qonnx_models_convert_or_are_refused_by_name(tmp_path, seed, rounds):
    """Brevitas's QONNX export with its quantizers' attributes, scales, zero points and bit widths mutated: each
    either converts (verified, and computing QONNX's definition of the mutated file) or is refused with a ModelError
    or VerificationError, in bounded time, nothing partial written, the input untouched."""
    rng = random.Random(seed)
    model = onnx.load(_QONNX)
    for _ in range(rounds):
        _mutate_qonnx(model, rng)
    folder = _case_folder(tmp_path, f"qonnx-{seed}-{rounds}")
    src = folder / "in.onnx"
    data = model.SerializeToString()
    src.write_bytes(data)
    # numpy on a scale of 1e-30 or inf warns before the refusal
    result = _converts_or_is_refused(src, folder, {"in.onnx"}, ignore=(RuntimeWarning,))
    assert src.read_bytes() == data
    if result is not None:  # whatever converts computes QONNX's definition of the file
        from recal_onnx.pipeline import read_input

        from tests.support.onnx_graphs import qonnx_reference

        shape = [d.dim_value or 1 for d in model.graph.input[0].type.tensor_type.shape.dim]
        reading = read_input(model, model, "in.onnx")[0]  # the QDQ the converter read: what onnxruntime runs
        _computes_the_definition(result, lambda feeds: qonnx_reference(model, feeds), shape, seed,
                                 reading=reading)


_ENCODING_VALUES = [None, 0, -1, 1, 3, 8, 16, 33, -128, -300, 0.5, 1e-30, 1e30, float("nan"), "x", [], [1, 2],
                    {"a": 1}, "PER_BLOCK", "FLOAT", True]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
@given(st.integers(0, 2**32 - 1), st.integers(1, 4))
def test_mutated_aimet_encodings_convert_or_are_refused_by_name(tmp_path, seed, edits):
    """AIMET's encodings (both layouts) with fields changed, dropped or added at random, as JSON files: each converts
    (verified, and computing AIMET's simulation with the mutated encodings) or is refused with a ModelError, in
    bounded time, nothing partial written."""
    import json

    from tests.support.onnx_graphs import aimet_layer

    rng = random.Random(seed)
    model, encodings, _ = aimet_layer(legacy=rng.random() < 0.3)
    for _ in range(edits):
        section = encodings[rng.choice(["activation_encodings", "param_encodings"])]
        entries = section if isinstance(section, list) else [e for value in section.values() for e in value]
        entry = rng.choice(entries)
        key = rng.choice(sorted(entry) + ["extra"])
        if rng.random() < 0.2:
            entry.pop(key, None)
        else:
            entry[key] = rng.choice(_ENCODING_VALUES)
    folder = _case_folder(tmp_path, f"encodings-{seed}-{edits}")
    (folder / "model.encodings").write_text(json.dumps(encodings))
    result = _converts_or_is_refused(model, folder, {"model.encodings"}, ignore=(Warning,),
                                     encodings=folder / "model.encodings")
    if result is not None:  # whatever converts computes AIMET's simulation with those encodings
        from tests.support.onnx_graphs import aimet_reference

        _computes_the_definition(result, lambda feeds: aimet_reference(model, encodings, feeds), [2, 3, 6, 6], seed)


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
    assert time.perf_counter() - started < PATTERN_SECONDS + 4.0  # the budget is wall-clock: load adds little


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

    from tests.support.onnx_graphs import Builder, reference, run

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

    from recal_app.errors import DivergedError
    from recal_app.training import check_finite
    from recal_torch import ScheduledModifierManager

    from tests.support.torch_models import SmallCNN, batches

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
        except DivergedError as exc:
            stopped = step
            assert f"diverged at step {step}" in str(exc)
            break
    poisoned = any(not torch.isfinite(p).all() for p in model.parameters())
    assert stopped is not None or not poisoned


# --- round 4: the Q/DQ attribute space, outputs of mixed types, large islands, perturbed conversions -------------

def _located(message: str, model) -> bool:
    """A refusal names where: a node, a tensor or an output of ``model``, or the attribute it cannot take."""
    names = {n.name for n in model.graph.node} | {o for n in model.graph.node for o in n.output} | {
        t.name for t in model.graph.initializer} | {"block_size", "opset"}
    return any(name and name in message for name in names)


@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(st.sampled_from([13, 17, 19, 21]), st.sampled_from(["Conv", "MatMul", "Gemm"]),
       st.sampled_from(["tensor", "channel", "block"]), st.sampled_from([None, 0, 1]),
       st.sampled_from([np.uint8, np.int8]), st.integers(0, 2**16))
def test_the_qdq_attribute_space_converts_exactly_or_is_refused_by_name(tmp_path, opset, layer, granularity,
                                                                         saturate, act_type, seed):
    """Opsets 13 to 21, per-tensor, per-channel (any axis the layer's output channels lie on) and blocked weights,
    ``saturate`` written or not, uint8 or int8 activations: the written model agrees with the QDQ model run as
    written (within a step op by op, 3 end to end, checked here again), or the refusal names the node, tensor or
    attribute it cannot take, in bounded time; nothing is written on a refusal."""
    import onnx

    from recal_onnx import ModelError, VerificationError, quantize_qat_export

    from tests.support.onnx_graphs import Builder, reference, run

    b = Builder(seed=seed)
    zp = 128 if act_type is np.uint8 else 0
    x = b.qdq("x", 0.05, zp, act_type)
    shape, axis = {"Conv": ((6, 4, 3, 3), 0), "MatMul": ((4, 6), 1), "Gemm": ((6, 4), 0)}[layer]
    w = b.rng.standard_normal(shape).astype(np.float32) * 0.3
    attrs = {}
    if granularity == "tensor":
        scale = np.float32(np.abs(w).max() / 127)
    elif granularity == "channel":
        scale = (np.abs(np.moveaxis(w, axis, 0)).reshape(shape[axis], -1).max(1) / 127).astype(np.float32)
        attrs["axis"] = axis
    else:  # blocks of 2 along the other axis of a 2-D weight, or the input channels of a conv
        other = 1 if axis == 0 else 0
        blocks = list(shape)
        blocks[other] //= 2
        scale = np.full(blocks, np.abs(w).max() / 127, np.float32)
        attrs.update(axis=other, block_size=2)
    broadcast = np.reshape(scale, [-1 if i == axis else 1 for i in range(len(shape))]) if granularity == "channel" \
        else (np.repeat(scale, 2, axis=attrs["axis"]) if granularity == "block" else scale)
    q = np.clip(np.round(w / broadcast), -127, 127).astype(np.int8)
    weight = b.node("DequantizeLinear", [b.const(q, "w"), b.const(scale, "ws"), b.const(np.zeros_like(q, shape=np.shape(
        scale)), "wz")], **attrs)
    if layer == "Conv":
        y = b.node("Conv", [x, weight], pads=[1, 1, 1, 1])
        in_shape, feed_shape = [None, 4, 5, 5], (16, 4, 5, 5)
    elif layer == "MatMul":
        y = b.node("MatMul", [x, weight])
        in_shape, feed_shape = [None, 4], (16, 4)
    else:
        step = 0.05 * (np.float32(np.abs(w).max() / 127) if granularity != "channel" else scale)
        bias = (np.round(b.rng.standard_normal(6) * 0.1 / step) * step).astype(np.float32)  # on its int32 grid
        y = b.node("Gemm", [x, weight, b.const(bias)], transB=1)
        in_shape, feed_shape = [None, 4], (16, 4)
    s, z = b.const(np.float32(0.08)), b.const(np.array(zp, act_type))
    q_attrs = {"saturate": saturate} if saturate is not None and opset >= 19 else {}
    out = b.node("DequantizeLinear", [b.node("QuantizeLinear", [y, s, z], **q_attrs), s, z])
    model = b.model([("x", in_shape)], [out])
    model.opset_import[0].version = opset
    model.ir_version = 10 if opset >= 21 else 8
    feeds = {"x": np.random.default_rng(seed).standard_normal(feed_shape).astype(np.float32)}
    target = tmp_path / f"attrs-{seed}-{opset}-{layer}-{granularity}.onnx"
    target.unlink(missing_ok=True)
    started = time.perf_counter()
    try:
        quantize_qat_export(model, target, inputs=feeds)
    except (ModelError, VerificationError) as err:
        assert _located(str(err), model), str(err)
        assert not target.exists() and time.perf_counter() - started < RECIPE_SECONDS + 3
        assert granularity == "block", str(err)  # only blocked weights may be refused here
        return
    (want,), (got,) = reference(model, feeds), run(onnx.load(target), feeds)
    assert np.abs(want - got).max() <= 3 * 0.08 * (1 + 1e-6)


@settings(max_examples=25, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(st.lists(st.sampled_from(["integer", "float", "bool", "nan", "class ids"]), min_size=1, max_size=5),
       st.integers(0, 2**16))
def test_outputs_of_mixed_types_are_each_compared_in_their_own_units(tmp_path, kinds, seed):
    """A QDQ model with several outputs of mixed types (an integer tensor, a float one, a bool, a float bearing NaN,
    class ids): a written model agrees with it output by output (bools equal, NaN where the QDQ model has NaN,
    integers within 3 steps, class ids on 95%); never written otherwise."""
    import onnx
    from onnx import TensorProto, helper

    from recal_onnx import ModelError, VerificationError, quantize_qat_export

    from tests.support.onnx_graphs import Builder, reference, run

    b = Builder(seed=seed)
    y = b.node("Relu", [b.node("Conv", [b.qdq("x", 0.04, 128), b.weight((6, 3, 1, 1))])])
    s, z = b.const(np.float32(0.05)), b.const(np.uint8(0))
    q = b.node("QuantizeLinear", [y, s, z])
    dq = b.node("DequantizeLinear", [q, s, z])
    made = {"integer": (q, TensorProto.UINT8), "float": (dq, TensorProto.FLOAT)}
    made["bool"] = (b.node("Greater", [dq, b.const(np.float32(0.3))]), TensorProto.BOOL)
    made["nan"] = (b.node("Sqrt", [b.node("Sub", [dq, b.const(np.float32(0.2))])]), TensorProto.FLOAT)
    made["class ids"] = (b.node("ArgMax", [b.node("Flatten", [b.node("GlobalAveragePool", [dq])])], axis=1,
                                keepdims=0), TensorProto.INT64)
    model = b.model([("x", [None, 3, 4, 4])], [])
    model.graph.output.extend(helper.make_tensor_value_info(made[k][0], made[k][1], None) for k in dict.fromkeys(kinds))
    feeds = {"x": np.random.default_rng(seed).standard_normal((32, 3, 4, 4)).astype(np.float32)}
    target = tmp_path / f"mixed-{seed}-{'-'.join(kinds).replace(' ', '')}.onnx"
    target.unlink(missing_ok=True)
    try:
        quantize_qat_export(model, target, inputs=feeds)
    except (ModelError, VerificationError) as err:
        assert _located(str(err), model) and not target.exists(), str(err)
        return
    for kind, want, got in zip(dict.fromkeys(kinds), reference(model, feeds), run(onnx.load(target), feeds)):
        if kind in ("bool", "nan"):
            assert np.array_equal(np.isnan(want), np.isnan(got)) if kind == "nan" else np.array_equal(want, got)
        if kind == "nan":
            assert np.nanmax(np.abs(want - got), initial=0) <= 0.1 * np.nanmax(want) + 3 * 0.05
        elif kind == "class ids":
            assert np.mean(want == got) >= 0.95
        elif kind != "bool":
            assert np.abs(want.astype(float) - got.astype(float)).max() <= 3 * (1 if kind == "integer" else 0.05)


_UNARY = [("Relu",), ("Sigmoid",), ("Tanh",), ("Abs",), ("Neg",), ("Mul", 0.9), ("Add", 0.05), ("Mul", 1.1)]


@settings(max_examples=6, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(st.integers(1, 3000), st.integers(0, 2**16))
def test_generated_elementwise_islands_up_to_thousands_of_nodes(tmp_path, size, seed):
    """An island of ``size`` elementwise nodes between a DequantizeLinear and a QuantizeLinear, each reading one or
    two earlier values of the island (a DAG, not only a chain): converted into one table in time linear in its size
    (the bound: 2 ms a node, well above the 0.7 a 10,000-node chain takes), and equal to the QDQ model run as
    written within a step."""
    import onnx

    from recal_onnx import UnconvertedOpsWarning, quantize_qat_export

    from tests.support.onnx_graphs import Builder, reference, run

    b = Builder(seed=seed)
    rng = random.Random(seed)
    values = [b.qdq("x", 0.02, 128)]
    for _ in range(size):
        if len(values) > 1 and rng.random() < 0.15:  # a join of two earlier values
            values.append(b.node(rng.choice(["Add", "Mul", "Max"]), rng.sample(values[-8:], 2)))
        else:
            op, *extra = rng.choice(_UNARY)
            values.append(b.node(op, [rng.choice(values[-4:]), *(b.const(np.float32(v)) for v in extra)]))
    last = b.node("Tanh", [values[-1]])  # every island value bounded before it is quantized
    s, z = b.const(np.float32(2 / 255)), b.const(np.uint8(128))
    model = b.model([("x", [None, 8])], [b.node("QuantizeLinear", [last, s, z])])
    model.graph.output[0].type.tensor_type.elem_type = onnx.TensorProto.UINT8
    feeds = {"x": np.random.default_rng(seed).standard_normal((64, 8)).astype(np.float32)}
    started = time.perf_counter()
    with warnings.catch_warnings(record=True) as said:  # a long island may squash every input to one value
        warnings.filterwarnings("ignore", "the verification compared nothing")
        warnings.simplefilter("always", UnconvertedOpsWarning)
        result = quantize_qat_export(model, tmp_path / f"island-{seed}-{size}.onnx", inputs=feeds)
    assert time.perf_counter() - started < HANG_SECONDS + 0.01 * size
    kinds = [n.op_type for n in result.model.graph.node]
    # one table; or, where the ReLU of a value and the value itself meet again (the ReLU moved onto the integers
    # first: two dequantized inputs), the island stays float, exact, each node named with its reason
    assert kinds[-2:] == ["Cast", "Gather"] and set(kinds) <= {"QuantizeLinear", "Max", "Cast", "Gather"} or (
        said and all("left in float" in str(w.message) and "its input" in str(w.message) or "Tanh" in str(w.message)
                     for w in said if w.category is UnconvertedOpsWarning)), (kinds, [str(w.message) for w in said])
    (want,), (got,) = reference(model, feeds), run(result.model, feeds)
    assert np.abs(want.astype(int) - got.astype(int)).max() <= 1


@pytest.fixture(scope="module")
def converted_net():
    """A small QDQ conv net (conv-relu, conv, residual add, pool, gemm) and its verified conversion."""
    import onnx

    from recal_onnx import quantize_qat_export

    from tests.support.onnx_graphs import Builder

    b = Builder(seed=3)
    x = b.qdq("x", 0.0413, 128)  # scales in no simple ratio (a ratio of 2 puts a mean of 36 on ties)
    y = b.qdq(b.node("Relu", [b.node("Conv", [x, b.weight((8, 3, 3, 3))], pads=[1, 1, 1, 1])]), 0.0291, 0)
    z = b.qdq(b.node("Conv", [y, b.weight((8, 8, 3, 3))], pads=[1, 1, 1, 1]), 0.0537, 128)
    r = b.qdq(b.node("Relu", [b.node("Add", [z, y])]), 0.0389, 0)
    p = b.qdq(b.node("Flatten", [b.node("GlobalAveragePool", [r])]), 0.0173, 0)
    out = b.qdq(b.node("Gemm", [p, b.weight((5, 8)), b.const(np.zeros(5, np.float32))], transB=1), 0.0519, 128)
    model = b.model([("x", [None, 3, 6, 6])], [out])
    feeds = {"x": np.random.default_rng(0).standard_normal((64, 3, 6, 6)).astype(np.float32)}
    result = quantize_qat_export(model, inputs=feeds)
    assert result.verification.problem(None) is None
    return model, result.model, feeds, onnx


_OUTPUT_ZERO_POINT = {"QuantizeLinear": 2, "QLinearConv": 7, "QLinearAdd": 7, "QGemm": 8, "QLinearMatMul": 7,
                      "QLinearGlobalAveragePool": 4}


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 1000), st.integers(2, 60))
def test_a_conversion_moved_beyond_a_step_is_always_refused(converted_net, pick, shift):
    """Property: the converted model with any one integer tensor moved by 2 or more steps (its zero point shifted,
    towards the middle of its range, so no value saturates) is refused by the verification, whichever tensor."""
    from recal_onnx.verify import verify_models

    model, good, feeds, onnx = converted_net
    bad = onnx.ModelProto()
    bad.CopyFrom(good)
    nodes = [n for n in bad.graph.node if n.op_type in _OUTPUT_ZERO_POINT and len(n.input) > _OUTPUT_ZERO_POINT[n.op_type]]
    assert len(nodes) >= 4, [n.op_type for n in bad.graph.node]
    node = nodes[pick % len(nodes)]
    slot = _OUTPUT_ZERO_POINT[node.op_type]
    zp = onnx.numpy_helper.to_array(next(t for t in bad.graph.initializer if t.name == node.input[slot]))
    low, high = np.iinfo(zp.dtype).min, np.iinfo(zp.dtype).max
    moved = zp.astype(int) + (shift if zp.astype(int).max() + shift <= high else -shift)
    assert moved.min() >= low and moved.max() <= high
    node.input[slot] = node.input[slot] + "__moved"
    bad.graph.initializer.append(onnx.numpy_helper.from_array(moved.astype(zp.dtype), node.input[slot]))
    verdict = verify_models(model, bad, feeds, noise=False)
    assert verdict.problem(None) is not None, (node.op_type, node.name, shift, verdict)
