"""The readers' independent judge (recal_onnx.reading_judge) and the misreadings it exists for."""

import json

import numpy as np
import pytest

from recal_onnx import ModelError, quantize_qat_export
from recal_onnx.passes import qonnx_to_qcdq as reader

from tests.support.onnx_graphs import Builder, qonnx_model, qonnx_quant, qonnx_reference, run


def _conv_with_bias(bias_value: float, bias_scale: float):
    """x -> Quant -> Conv(Quant(w), Quant(b, 32 bits)) -> Quant: one bias as given."""
    b = Builder()
    rng = np.random.default_rng(0)
    x = qonnx_quant(b, "x", 0.05, 0, 8, narrow=0)
    w = qonnx_quant(b, b.const(rng.standard_normal((2, 3, 1, 1)).astype(np.float32) * 0.3), 0.01, 0, 8, narrow=1)
    bias = qonnx_quant(b, b.const(np.array([bias_value, -0.02], np.float32)), bias_scale, 0, 32, narrow=0)
    y = qonnx_quant(b, b.node("Conv", [x, w, bias]), 0.05, 0, 8, narrow=0)
    return qonnx_model(b, [("x", [1, 3, 4, 4])], [(y, [1, 2, 4, 4])])


def test_a_32_bit_bias_past_int32_keeps_its_sign(tmp_path):
    """A QONNX bias whose value over its scale passes 2^31 clips to 2^31 - 1 as QONNX defines; it wrapped to -2^31
    (a sign flip) and verified 'exact' against the converter's own reading."""
    model = _conv_with_bias(3.0, 1e-9)  # 3e9 steps: beyond int32, clipped to 2^31 - 1, about 2.147
    result = quantize_qat_export(model, tmp_path / "int8.onnx")
    feeds = {"x": np.random.default_rng(1).standard_normal((1, 3, 4, 4)).astype(np.float32)}
    want, got = qonnx_reference(model, feeds)[0], run(result.model, feeds)[0]
    assert np.abs(want - got).max() <= 0.05 + 1e-6, (want, got)  # one output step at most
    assert want[0, 0].min() > 1.5  # the clipped bias (+2.147) dominates: a flipped one would give about -2.1


def test_the_judge_refuses_a_reader_that_misreads(monkeypatch, tmp_path):
    """A reader that flips a constant's sign is caught by QONNX's own definition, evaluated on the original file,
    before anything is written: the converter's verification alone compares with the reading and would pass."""
    monkeypatch.setitem(reader.ROUNDING, "ROUND", lambda v: -np.round(v))
    with pytest.raises(ModelError, match=r"recal's reading of QONNX Quant .* differs from QONNX's own definition"
                                         r".*a defect of the converter's reader, not of your model"):
        quantize_qat_export(_conv_with_bias(0.1, 1e-4), tmp_path / "int8.onnx")
    assert not list(tmp_path.iterdir())


def test_an_encodings_tensor_given_twice_is_refused(tmp_path):
    """JSON keeps the last of a key given twice, silently; the 1.0.0 layout's list can name a tensor twice, which
    quantized it twice in a row: both refused by name."""
    from tests.support.onnx_graphs import aimet_layer

    model, entries, _ = aimet_layer()
    twice = dict(entries, activation_encodings=entries["activation_encodings"] + entries["activation_encodings"][:1])
    with pytest.raises(ModelError, match=r"tensor 'x' has two encodings"):
        quantize_qat_export(model, tmp_path / "a.onnx", encodings=twice)
    _, legacy, _ = aimet_layer(legacy=True)
    text = json.dumps(legacy)
    key = '"x": ['
    doubled = text.replace(key, '"x": [{"bitwidth": 8, "dtype": "int", "offset": -3, "scale": 0.5}], ' + key, 1)
    (tmp_path / "dup.encodings").write_text(doubled)
    with pytest.raises(ModelError, match=r"dup.encodings: not a JSON encodings file \(key 'x' is given twice"):
        quantize_qat_export(model, tmp_path / "b.onnx", encodings=tmp_path / "dup.encodings")
    (tmp_path / "deep.encodings").write_text("[" * 200_000 + "]" * 200_000)
    with pytest.raises(ModelError, match=r"deep.encodings: nested deeper than a JSON parser can follow"):
        quantize_qat_export(model, tmp_path / "c.onnx", encodings=tmp_path / "deep.encodings")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["deep.encodings", "dup.encodings"]


def test_a_graph_input_that_is_also_an_output_keeps_its_name(tmp_path):
    """With an encoding on it, the written model's input kept its name (it became 'x__recal4')."""
    import onnx
    from onnx import TensorProto, helper

    from tests.support.onnx_graphs import aimet_layer

    model, entries, _ = aimet_layer()
    model.graph.output.append(helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 6, 6]))
    result = quantize_qat_export(model, tmp_path / "a.onnx", encodings=entries)
    written = onnx.load(str(result.path))
    assert [i.name for i in written.graph.input] == ["x"] and "x" in [o.name for o in written.graph.output]
    assert any("is also a graph output" in note for note in result.notes)


def test_a_weight_scaled_per_input_channel_converts_and_runs_in_a_default_session(tmp_path):
    """A QONNX conv weight whose scale has shape [1, C_in, 1, 1]: onnxruntime's own default session of the QDQ
    reading fails at run time (its QLinearConv fusion refuses the scale), which verification says rather than
    crashing; the conv is left float with that reason, and the written model runs in a default session and computes
    QONNX's definition."""
    import onnxruntime as ort

    b = Builder()
    rng = np.random.default_rng(0)
    x = qonnx_quant(b, "x", 0.05, 0, 8, narrow=0)
    scales = np.array([0.01, 0.02, 0.03], np.float32).reshape(1, 3, 1, 1)
    w = qonnx_quant(b, b.const(rng.standard_normal((2, 3, 1, 1)).astype(np.float32) * 0.3), scales, 0, 8, narrow=1)
    y = qonnx_quant(b, b.node("Conv", [x, w]), 0.05, 0, 8, narrow=0)
    model = qonnx_model(b, [("x", [1, 3, 4, 4])], [(y, [1, 2, 4, 4])])
    with pytest.warns(UserWarning, match=r"scales are along axis 1, not its output channels"):
        result = quantize_qat_export(model, tmp_path / "int8.onnx")
    assert "onnxruntime's default session cannot run the input (it fails when run" in str(result.verification)
    feeds = {"x": rng.standard_normal((1, 3, 4, 4)).astype(np.float32)}
    got = ort.InferenceSession(str(tmp_path / "int8.onnx"), providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    assert np.abs(got - qonnx_reference(model, feeds)[0]).max() <= 0.05 + 1e-6


@pytest.mark.parametrize("misreading", ["scale", "offset"])
def test_the_judge_refuses_an_encodings_reader_that_misreads(monkeypatch, tmp_path, misreading):
    """AIMET's encodings: a reader that doubles a weight's scales, or flips an activation's offset, is caught by
    AIMET's simulation evaluated on the float model, before anything is written; the reader as it is passes, and
    the converted model computes that simulation."""
    import dataclasses

    import onnx

    from recal_onnx.passes import encodings_to_qdq as aimet_reader
    from recal_onnx.reading_judge import aimet_definition
    from recal_onnx.aimet_encodings import load_encodings

    from tests.support.onnx_graphs import aimet_layer

    model, entries, w = aimet_layer()
    result = quantize_qat_export(model, tmp_path / "good.onnx", encodings=entries)
    assert not any("not compared" in n or "could not be compared" in n for n in result.notes), result.notes
    feeds = {"x": np.random.default_rng(3).uniform(-3, 4, (2, 3, 6, 6)).astype(np.float32)}
    definition, simulated = aimet_definition(model, load_encodings(entries))
    del definition.graph.output[:]  # the output as AIMET simulates it: its encoding applied
    definition.graph.output.append(onnx.helper.make_empty_tensor_value_info(simulated[model.graph.output[0].name][0]))
    steps = np.abs(run(definition, feeds)[0] - run(result.model, feeds)[0]) / 0.02
    assert steps.max() <= 1 + 1e-3 and np.count_nonzero(steps > 1e-3) <= 0.001 * steps.size
    if misreading == "scale":
        wrong, target = (lambda e: dataclasses.replace(e, scales=e.scales * 2)), "_parameter"
    else:
        wrong, target = (lambda e: dataclasses.replace(e, offsets=np.minimum(-e.offsets, 0) - 8)), "_activation"
    original = getattr(aimet_reader, target)
    monkeypatch.setattr(aimet_reader, target, lambda g, value, e: original(g, value, wrong(e)))
    with pytest.raises(ModelError, match=r"recal's reading of the AIMET encoding of '.*' differs from AIMET's "
                                         r"simulation .*a defect of the converter's reader, not of your model"):
        quantize_qat_export(model, tmp_path / "bad.onnx", encodings=entries)
    assert not list(tmp_path.glob("bad*"))


def test_a_biased_conv_whose_weight_scales_run_along_its_kernel_converts(tmp_path):
    """A QONNX weight scale of shape [3] broadcasts along a [4, 3, 3, 3] kernel's last axis (its width): with a
    float bias, the int32 bias was computed against those 3 scales and crashed on a broadcast naming nothing (found
    by the fuzz test). The conv stays float with that reason and computes QONNX's definition."""
    b = Builder()
    rng = np.random.default_rng(0)
    x = qonnx_quant(b, "x", 0.05, 0, 8, narrow=0)
    scales = np.array([0.01, 0.02, 0.03], np.float32)
    w = qonnx_quant(b, b.const(rng.standard_normal((4, 3, 3, 3)).astype(np.float32) * 0.3), scales, 0, 8, narrow=1)
    conv = b.node("Conv", [x, w, b.const(rng.standard_normal(4).astype(np.float32) * 0.1)], pads=[1, 1, 1, 1])
    model = qonnx_model(b, [("x", [1, 3, 5, 5])], [(qonnx_quant(b, conv, 0.05, 0, 8, narrow=0), [1, 4, 5, 5])])
    with pytest.warns(UserWarning, match=r"scales are along axis 3, not its output channels"):
        result = quantize_qat_export(model, tmp_path / "int8.onnx")
    feeds = {"x": rng.standard_normal((1, 3, 5, 5)).astype(np.float32)}
    assert np.abs(run(result.model, feeds)[0] - qonnx_reference(model, feeds)[0]).max() <= 0.05 + 1e-6
