"""Verification cannot be switched off by accident: every graph output is compared end to end in its own units
(integer steps, class-id agreement, share of a float range), whether or not the op-by-op check also ran. A wrong
model of each output kind is refused; the right one passes."""

import numpy as np
import pytest

from recal_onnx.verify import verify_models

from tests.support.paths import ROOT
from tests.support.hang_guard import HANG_SECONDS
from tests.support.onnx_graphs import Builder


def _model(kind: str, wrong: bool = False):
    """x -> Conv -> an output of ``kind``: a uint8 QuantizeLinear output, an ArgMax's class ids, or float logits
    behind a DequantizeLinear. A ``wrong`` conversion of the same model differs where the op-by-op check does not
    look (a graph output's own integers; the ops after the last DequantizeLinear)."""
    b = Builder(seed=1)
    w = (b.rng.standard_normal((6, 3, 1, 1)) * 0.5).astype(np.float32)
    y = b.node("Conv", [b.qdq("x", 0.02, 128), b.const(-w if wrong and kind == "integer" else w)])
    y = b.node("GlobalAveragePool", [y])
    y = b.node("Flatten", [y])
    s, z = b.const(np.float32(0.02)), b.const(np.uint8(128))
    q = b.node("QuantizeLinear", [y, s, z])
    if kind == "integer":
        out = q
    else:
        out = b.node("DequantizeLinear", [q, s, z])
        if wrong:
            out = b.node("Neg", [out])
        if kind == "class ids":
            out = b.node("ArgMax", [out], axis=1, keepdims=0)
    model = b.model([("x", [None, 3, 4, 4])], [out])
    # the Builder declares float outputs; an integer output is declared as what it is
    dtype = {"integer": 2, "class ids": 7}.get(kind)
    if dtype:
        model.graph.output[0].type.tensor_type.elem_type = dtype
    return model


@pytest.mark.parametrize("kind", ["integer", "class ids", "float"])
def test_a_wrong_model_of_each_output_kind_is_refused(kind):
    feeds = {"x": np.random.default_rng(0).standard_normal((64, 3, 4, 4)).astype(np.float32)}
    right = verify_models(_model(kind), _model(kind), feeds)
    assert right.problem(None) is None, right
    wrong = verify_models(_model(kind), _model(kind, wrong=True), feeds)
    problem = wrong.problem(None)
    assert problem is not None and f"({kind})" in problem, (kind, wrong.outputs)
    (output,) = wrong.outputs
    assert output.kind == kind


@pytest.mark.parametrize("case", ["drift", "op by op", "agreement", "tolerance given"])
def test_a_refusal_for_end_to_end_drift_alone_says_how_to_accept_it(case):
    """Every integer op within a step of the QAT model's (op by op) but 5 output steps end to end: the refusal gives
    the measured figures and the tolerance that would accept them. A refusal for anything else (an op off by more
    than a step, too low an agreement asked for) or one under the user's own tolerance gets no such advice."""
    from recal_onnx.convert import _drift_note
    from recal_onnx.verify import OutputDiff, Verification

    output = OutputDiff("logits", "float", max_abs_diff=1.407, output_range=30.0, step=0.2814)
    v = Verification(max_abs_diff=1.407, output_range=30.0, argmax_agreement=0.99, samples=256, output_step=0.2814,
                     local_steps=3 if case == "op by op" else 1, local_tensor="t", local_tensors=120,
                     outputs=(output,))
    assert v.problem(None) is not None  # refused in every case
    note = _drift_note(v, 2.0 if case == "tolerance given" else None, 0.999 if case == "agreement" else None)
    if case == "drift":
        assert "within 1 step(s)" in note and "argmax agreement 0.9900" in note and "tolerance=1.421" in note
        assert "--tolerance" in note
    else:
        assert note == ""


def _amplifier(gain: float = 5.0, input_move: float = 0.0):
    """x -> QDQ -> Mul(gain) -> QDQ: one step of the first quantized tensor is ``gain`` steps of the output (as a
    per-tensor activation grid read by a large per-channel weight is in a real network). ``input_move`` multiplies
    the input by ``1 + input_move`` first: the same model with another kernel's rounding."""
    b = Builder(seed=2)
    x = b.node("Mul", ["x", b.const(np.float32(1 + input_move))])  # by 1 (exact) unless moved: the same names
    y = b.node("Mul", [b.qdq(x, 1.0, 128), b.const(np.float32(gain))])
    return b.model([("x", [None, 512])], [b.qdq(y, 1.0, 128)])


def test_the_default_accepts_what_the_qat_models_own_rounding_noise_reaches_and_nothing_else():
    """A value on a rounding boundary (2.5 and 3.5 steps) lands one step over in a model that differs only by
    its rounding, and the model carries that step on as 5 output steps: beyond the default 3. Op by op it is one
    step in one value, and moving each activation quantizer's input by 8 float32 ulps moves the QAT model itself
    as far, so the default accepts it and says why. A user's tolerance is taken as given; a wrong model (gain 6)
    is refused without the noise being measured."""
    from recal_onnx.verify import rounding_noise

    rng = np.random.default_rng(0)
    x = rng.uniform(-20, 20, (64, 512)).astype(np.float32)
    plain = {"x": x.copy()}
    x[0, 0], x[1, 0] = 2.5, 3.5  # exactly on boundaries: round half to even gives 2 and 4
    feeds = {"x": x}
    reference = _amplifier()
    assert rounding_noise(reference, plain, {"x"}) == {reference.graph.output[0].name: 0.0}
    assert rounding_noise(reference, feeds, {"x"})[reference.graph.output[0].name] == 5.0

    exact = verify_models(reference, _amplifier(input_move=2.0 ** -22), feeds, output_step=1.0)
    assert exact.max_abs_diff == 5.0 and exact.local_steps == 1 and 0 < exact.local_share <= 1e-3
    assert exact.clean_op_by_op and exact.outputs[0].noise == 5.0
    assert exact.problem(None) is None and exact.within_noise
    assert "own rounding noise" in str(exact) and "within which the difference is accepted" in str(exact)
    assert exact.problem(3.0) is not None  # the user's own tolerance: as given
    unmeasured = verify_models(reference, _amplifier(input_move=2.0 ** -22), feeds, output_step=1.0, noise=False)
    assert unmeasured.outputs[0].noise is None and "5.00 steps" in unmeasured.problem(None)

    wrong = verify_models(reference, _amplifier(gain=6.0), feeds, output_step=1.0)
    assert not wrong.clean_op_by_op and wrong.outputs[0].noise is None and not wrong.within_noise
    assert "op by op" in wrong.problem(None)


def test_cpu_exactness_script_runs_models_and_compares_two_machines_runs(tmp_path):
    """``scripts/cpu_exactness.py``: a run saves each model's outputs (both session levels) with what ran them; a
    comparison of a run with itself is exact, and one with a changed output says by how much."""
    import importlib.util
    import json

    import onnx

    spec = importlib.util.spec_from_file_location("cpu_exactness", ROOT / "scripts" / "cpu_exactness.py")
    cpu_exactness = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cpu_exactness)

    onnx.save(_amplifier(), tmp_path / "m.onnx")
    np.save(tmp_path / "x.npy", np.random.default_rng(0).uniform(-20, 20, (8, 512)).astype(np.float32))
    cpu_exactness.main(["run", str(tmp_path / "m.onnx"), "--inputs", str(tmp_path / "x.npy"),
                        "--out", str(tmp_path / "a.npz")])
    saved = dict(np.load(tmp_path / "a.npz"))
    assert set(saved) == {"__meta__", "m.onnx|default", "m.onnx|disabled"}
    assert "onnxruntime" in json.loads(str(saved["__meta__"]))
    same = cpu_exactness.compare(tmp_path / "a.npz", tmp_path / "a.npz")
    assert "| m.onnx | default | 0 | 1.0000 |" in same
    saved["m.onnx|default"] = saved["m.onnx|default"] + np.eye(8, 512, dtype=np.float32)
    np.savez(tmp_path / "b.npz", **saved)
    assert "| m.onnx | default | 1 | 0.9980 |" in cpu_exactness.compare(tmp_path / "a.npz", tmp_path / "b.npz")
    # a run file comes from another machine: each defect is one located line (exit 2), never a traceback
    good = dict(np.load(tmp_path / "a.npz"))
    bombs = {
        "objects": {**good, "m.onnx|default": np.array([object()], dtype=object)},
        "strings": {**good, "m.onnx|default": np.array(["a", "b"])},
        "no metadata": {k: v for k, v in good.items() if k != "__meta__"},
        "bad metadata": {**good, "__meta__": np.array("[1, 2]")},
        "deep metadata": {**good, "__meta__": np.array("[" * 200_000 + "]" * 200_000)},  # RecursionError in json
        "zeros": {**good, "big|default": np.zeros(64 * 2**20, np.uint8)},  # 64 MB inflated, 65 kB on disk
    }
    cpu_exactness.MAX_BYTES = 32 * 2**20  # (512 MB in use; a smaller bomb here)
    for name, arrays in bombs.items():
        np.savez_compressed(tmp_path / f"{name}.npz", **arrays) if name != "objects" else np.savez(
            tmp_path / f"{name}.npz", **arrays)
    for name in [*bombs, "a folder"]:
        path = tmp_path / f"{name}.npz" if name != "a folder" else tmp_path
        assert cpu_exactness.main(["compare", str(path), str(tmp_path / "a.npz")]) == 2, name
    shapes = {**good, "m.onnx|default": good["m.onnx|default"][:4]}
    np.savez(tmp_path / "shapes.npz", **shapes)
    assert "shapes differ: [8, 512] and [4, 512]" in cpu_exactness.compare(tmp_path / "a.npz", tmp_path / "shapes.npz")
    piped = {**good, "x|y|z|default": good["m.onnx|default"]}
    np.savez(tmp_path / "piped.npz", **piped)
    assert "| x | y\\|z\\|default |" in cpu_exactness.compare(tmp_path / "piped.npz", tmp_path / "piped.npz")


def _unary(*ops, out_type=None):
    """x -> ops in turn, the model's one output (bool where the last op makes one)."""
    from onnx import helper

    b = Builder()
    y = "x"
    for op, *extra in ops:
        y = b.node(op, [y, *(b.const(np.float32(v)) for v in extra)])
    model = b.model([("x", [4, 8])], [y])
    if out_type is not None:
        model.graph.output[0].CopyFrom(helper.make_tensor_value_info(y, out_type, None))
    return model


def test_bool_outputs_must_be_equal_and_nan_is_a_value():
    from onnx import TensorProto

    feeds = {"x": np.random.default_rng(0).standard_normal((4, 8)).astype(np.float32)}
    flipped = verify_models(_unary(("Greater", 0.0), out_type=TensorProto.BOOL),
                            _unary(("Greater", 0.5), out_type=TensorProto.BOOL), feeds, noise=False)
    assert "bools must be equal" in flipped.problem(None)  # 3 "steps" of a bool would let every value flip
    same = verify_models(_unary(("Sqrt",)), _unary(("Sqrt",)), feeds, noise=False)  # NaN where x < 0, in both
    assert same.problem(None) is None and same.max_abs_diff == 0
    one_side = verify_models(_unary(("Sqrt",)), _unary(("Abs",), ("Sqrt",)), feeds, noise=False)
    assert one_side.max_abs_diff == np.inf and "max abs difference inf" in one_side.problem(None)


def test_outputs_constant_over_the_inputs_say_the_check_compared_nothing():
    feeds = {"x": np.random.default_rng(0).standard_normal((4, 8)).astype(np.float32)}
    flat = verify_models(_unary(("Mul", 0.0)), _unary(("Mul", 0.0)), feeds, noise=False)
    assert flat.compared_nothing and flat.problem(None) is None
    assert not verify_models(_unary(("Mul", 2.0)), _unary(("Mul", 2.0)), feeds, noise=False).compared_nothing


def test_generated_inputs_are_bounded_before_anything_is_allocated():
    """What an input declares is checked before an array exists: 256 samples of a 4 MB input are cut to the 64
    that fit, with a warning that says so; one sample of 4 TB, or one fixed batch beyond the bound, is refused
    naming the input and its shape, at once."""
    import time

    from recal_onnx import ModelError
    from recal_onnx.verify_inputs import INPUT_BYTES, generated_inputs

    with pytest.warns(UserWarning, match="verification on 64 generated samples, not 256"):
        feeds = generated_inputs(_shaped(["n", 1024, 1024]))
    assert feeds["x"].shape == (64, 1024, 1024) and feeds["x"].nbytes <= INPUT_BYTES
    for shape, words in ((["n", 10**6, 10**6], r"input 'x' declares shape \[1, 1000000, 1000000\].*for one sample"),
                         ([8, 10**5, 10**3], r"input 'x' declares shape \[8, 100000, 1000\].*one batch of 8")):
        start = time.perf_counter()
        with pytest.raises(ModelError, match=words):
            generated_inputs(_shaped(shape))
        assert time.perf_counter() - start < HANG_SECONDS  # allocating it would take minutes or fail


def _shaped(shape):
    b = Builder()
    return b.model([("x", shape)], [b.node("Relu", ["x"])])


def test_three_steps_far_from_the_zero_point_are_three_steps():
    """A float32 output dequantized 100 steps from its zero point: two values 3 steps apart differ by 3 steps give
    or take a ulp of the value (onnxruntime's ``ActivationSymmetric`` uint8 outputs, zero point 128, were refused
    at "3.00 steps > 3.00 steps"). More than that is still refused."""
    from recal_onnx.verify import OutputDiff

    step = np.float32(0.0011173)
    a, b = np.float32(100) * step, np.float32(97) * step
    measured = float(np.float64(a) - np.float64(b))
    assert measured > 3 * float(step) * (1 + 1e-6)  # the float32 rounding alone is beyond the old slack
    ok = OutputDiff("logits", "float", max_abs_diff=measured, output_range=float(255 * step), step=float(step),
                    magnitude=float(a))
    assert ok.problem(None, None) is None
    far = OutputDiff("logits", "float", max_abs_diff=3.01 * float(step), output_range=float(255 * step),
                     step=float(step), magnitude=float(a))
    assert "max abs difference" in far.problem(None, None)


def test_a_pools_ties_are_counted_apart_only_up_to_the_share_that_can_tie():
    """An average pool on its input's grid (2x2: a quarter of its sums tie): verification counts at most that share
    of its differing values apart; told a smaller share, it counts the rest as usual and refuses."""
    from recal_onnx import quantize_qat_export

    b = Builder()
    y = b.node("AveragePool", [b.qdq("x", 0.05, 0)], kernel_shape=[2, 2], strides=[2, 2])
    model = b.model([("x", [8, 16, 4, 4])], [b.qdq(y, 0.05, 0)])
    feeds = {"x": np.abs(np.random.default_rng(3).standard_normal((64, 16, 4, 4))).astype(np.float32) * 3}
    converted = quantize_qat_export(model, verify=False).model
    pooled = next(n.output[0] for n in converted.graph.node if n.op_type == "QLinearAveragePool")
    honest = verify_models(model, converted, feeds, tied={pooled: 0.25})
    assert honest.local_tied == 1 and honest.local_share <= 1e-3 and honest.problem(None) is None, honest
    told_less = verify_models(model, converted, feeds, tied={pooled: 1e-4})
    # beyond the share told, the ties are still exact ties: each lies on a rounding boundary of the QAT model's own
    # value (margin 0), which is rounding, not a misreading
    assert told_less.local_share > 1e-3 and told_less.local_unexplained == 0 and told_less.local_margin < 1e-4, told_less


def test_open_dimensions_get_sizes_that_exercise_the_model():
    """A batch declared -1 and unnamed height and width (paddle2onnx) got a 1x1 image and a negative batch; a shared
    symbolic dimension gets one size everywhere; a name says what it is; --input-shape gives a whole shape."""
    from onnx import TensorProto, helper

    from recal_onnx.verify_inputs import generated_inputs

    def info(name, dims, kind=TensorProto.FLOAT):
        value = helper.make_tensor_value_info(name, kind, None)
        for d in dims:
            dim = value.type.tensor_type.shape.dim.add()
            if isinstance(d, int):
                dim.dim_value = d
            elif d:
                dim.dim_param = d
        return value

    graph = helper.make_graph([], "g", [info("x", [-1, 3, None, None]), info("ids", ["batch", "sequence_length"],
                                                                                TensorProto.INT64),
                                        info("mask", ["batch", "sequence_length"], TensorProto.INT64)], [])
    model = helper.make_model(graph)
    feeds = generated_inputs(model, 4)
    assert feeds["x"].shape == (4, 3, 32, 32) and feeds["ids"].shape == (4, 16) == feeds["mask"].shape
    shaped = generated_inputs(model, 4, shapes={"x": [1, 3, 64, 48]})
    assert shaped["x"].shape == (4, 3, 64, 48)
    with pytest.raises(ValueError, match="input_shapes names 'y', which the model does not take"):
        generated_inputs(model, 4, shapes={"y": [1, 2]})


def test_a_negative_or_zero_activation_scale_is_refused_by_name():
    """A learned scale left negative (exported as -1.0) or 0 (a division by zero): the QAT model's integers there mean
    nothing, refused naming the node, never verified."""
    from recal_onnx import ModelError, quantize_qat_export

    from tests.support.onnx_graphs import Builder

    for bad in (-1.0, 0.0):
        b = Builder()
        y = b.node("Relu", [b.qdq("x", bad, 0)])
        model = b.model([("x", [1, 4])], [b.qdq(y, 0.1, 0)])
        with pytest.raises(ModelError, match=r"has a scale of \[-?[01]\.0\].*a scale is positive"):
            quantize_qat_export(model)


def test_a_thinned_tensors_boundary_is_judged_on_its_own_kept_channels():
    """Op by op, a differing integer of a tensor whose channels the candidate thinned is judged against the QAT
    model's unrounded value of that same channel (the tensor's own kept channels). Another thinned tensor's channels
    were taken before: a real model (RapidOCR's recognizer, two squeeze-excitation convs thinned) was refused with
    values 'inf steps' from their boundary, and a value misread by a step could have been judged on a channel that
    happened to tie."""
    from recal_onnx.op_by_op import _boundary_margin

    unrounded = np.array([[0.2, 7.5, 3.0, 9.9]], np.float32)  # x / scale, zero point 0: channel 1 ties at 7.5
    grid = ("x", np.float32(1.0), np.uint8(0), None)
    qat = np.array([[8, 10]], np.uint8)  # the QAT model's integers of the kept channels 1 and 3
    got = np.array([[7, 10]], np.uint8)  # channel 1 rounded down: a tie, rounding
    margin, count = _boundary_margin(grid, {"x": unrounded}, got, qat, qat, np.array([1, 3]))
    assert margin == 0.0 and count == 0
    wrong = _boundary_margin(grid, {"x": unrounded}, got, qat, qat, np.array([0, 2]))  # another tensor's channels
    assert wrong[1] == 1 and wrong[0] > 0.4


def test_as_close_as_onnxruntimes_session_is_judged_paired_on_the_task():
    """recal's model may read a few more positions otherwise than onnxruntime's own session of the file does, by
    chance (each flip a coin toss); many more is a worse model, refused, however close the per-sample figures."""
    from recal_onnx.output_diff import OutputDiff, OutputStats

    def judged(paired, task=0.953):
        runtime = OutputDiff("probs", "float", 0.9, 1.0, typical=(0.18, 0.30), task=0.962)
        return OutputDiff("probs", "float", 0.98, 1.0, typical=(0.19, 0.32), task=task, runtime=runtime,
                          explained=True, task_paired=paired).as_close_as_runtime()

    assert judged((15, 8))  # 7 more lost than won, of 23: chance (2 sd is 9.6)
    assert not judged((60, 8))  # 52 more, of 68: a worse model
    assert not judged(None)  # nothing paired: the margin alone, which 0.953 misses
    assert judged(None, task=0.96)
    stats = OutputStats()
    ref = np.eye(4, dtype=np.float32)[None].repeat(2, 0)  # [2, 4 positions, 4 classes]
    got, other = ref.copy(), ref.copy()
    got[0, 0], other[1, 1] = ref[0, 1], ref[1, 2]  # each reads one position otherwise
    got[1, 3] = ref[1, 0]
    stats.pair(stats.add(ref, got), OutputStats().add(ref, other))
    assert (stats.task_worse, stats.task_better) == (2, 1)
