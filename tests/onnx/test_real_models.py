"""Real pretrained weights (RapidOCR's text-direction classifier, PaddleOCR's, shipped in its wheel) quantized by
onnxruntime's quantize_static as a user would, and by NNCF's and ModelOpt's ONNX quantizers, converted and judged on
rendered text (scripts/real_models)."""

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from real_models.rapidocr_quantize import text_lines
from recal_onnx import quantize_qat_export

ROOT = Path(__file__).parents[2]

FIXTURES = ROOT / "tests" / "fixtures" / "real"
QDQ, FP32 = FIXTURES / "rapidocr-cls-quantize-static.onnx", FIXTURES / "rapidocr-cls-fp32.onnx"


pytestmark = pytest.mark.filterwarnings("ignore::recal_onnx.UnconvertedOpsWarning")  # each float op says why (below)


@pytest.fixture(scope="module")
def lines():
    return text_lines(48, seed=2)


def test_a_real_quantize_static_model_converts_on_the_users_data(lines, tmp_path):
    """Batch -1, open height and width, 35 BatchNorms between quantizers (no pre-processing): every conv and every
    BatchNorm integer, verified on rendered text; on that text it classifies as the fp32 model does at least as
    often as onnxruntime's own default session of the QDQ file."""
    images, labels = lines
    result = quantize_qat_export(QDQ, tmp_path / "int8.onnx", inputs={"x": images[:32]})
    kinds = [n.op_type for n in result.model.graph.node]
    assert "Conv" not in kinds and "BatchNormalization" not in kinds and kinds.count("QLinearConv") >= 88, kinds
    assert any("BatchNormalization nodes between two quantizers run as integer depthwise convs" in n
               for n in result.notes)
    assert all(name in result.float_reasons for _, name in result.float_nodes)  # every float op with its reason
    v = result.verification
    assert v.explained and v.local_unexplained == 0, v
    fp32 = ort.InferenceSession(str(FP32), providers=["CPUExecutionProvider"]).run(None, {"x": images})[0].argmax(1)
    ours = ort.InferenceSession(str(result.path), providers=["CPUExecutionProvider"]).run(None, {"x": images})[0]
    theirs = ort.InferenceSession(str(QDQ), providers=["CPUExecutionProvider"]).run(None, {"x": images})[0]
    assert (ours.argmax(1) == fp32).mean() >= (theirs.argmax(1) == fp32).mean() - 1 / 48
    assert (fp32 == labels).mean() >= 0.9  # the real model reads the rendered text: the data is what it is for


def test_generated_inputs_run_the_real_model_and_a_refusal_names_the_users_data(tmp_path):
    """Without inputs, the -1 batch and the open height and width get 32 each (a 1x1 image and a negative batch were
    refused as 'does not run in onnxruntime itself'); whatever the verdict on noise, it is never the file's fault and
    a refusal says how to give real data and prints onnxruntime's own figures beside recal's."""
    from recal_onnx import VerificationError

    try:
        result = quantize_qat_export(QDQ, tmp_path / "int8.onnx")
    except VerificationError as exc:
        text = str(exc)
        assert "--inputs FILE.npz" in text and "onnxruntime's default session of the input" in text, text
        assert "does not run in onnxruntime" not in text
        assert not list(tmp_path.iterdir())
    else:
        assert result.verification.samples == 256


def test_the_cli_takes_the_users_inputs_and_shapes(lines, tmp_path, capsys):
    from recal_app.cli import main

    np.savez(tmp_path / "in.npz", x=lines[0][:16])
    assert main(["quantize-qat-export", str(QDQ), str(tmp_path / "a.onnx"), "--inputs", str(tmp_path / "in.npz")]) == 0
    assert "onnxruntime's default session of the input" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["quantize-qat-export", str(QDQ), str(tmp_path / "b.onnx"), "--input-shape", "x=1,3,0,4"])
    assert "dimensions of at least 1" in capsys.readouterr().err
    bad = tmp_path / "bad.npz"
    np.savez(bad, y=lines[0][:2])
    assert main(["quantize-qat-export", str(QDQ), str(tmp_path / "c.onnx"), "--inputs", str(bad)]) != 0
    assert "inputs names 'y', which" in capsys.readouterr().err
    assert not (tmp_path / "b.onnx").exists() and not (tmp_path / "c.onnx").exists()


@pytest.mark.parametrize("tool", ["nncf", "modelopt"])
def test_peers_quantizations_of_the_real_model_convert(tool, lines, tmp_path):
    """The same classifier quantized by NNCF's and ModelOpt's ONNX quantizers at their defaults
    (scripts/real_models/peer_quantize.py wrote the fixtures). NNCF keeps paddle2onnx's opset 11: the per-channel
    scales the converter makes there (a BatchNorm folded into the float first conv) are onnxruntime's own
    DequantizeLinear, and MaxPool, with no 8-bit type before opset 12, stays float. Both leave most convs' outputs
    unquantized, so those convs compute in float, as in the file, each with its reason."""
    from recal_onnx.ir_edits import MS_DOMAIN

    images, _ = lines
    qdq = FIXTURES / f"rapidocr-cls-{tool}.onnx"
    result = quantize_qat_export(qdq, tmp_path / "int8.onnx", inputs={"x": images[:32]})
    model = onnx.load(str(result.path))
    assert all(n.domain == MS_DOMAIN for n in model.graph.node
               if n.op_type == "DequantizeLinear" and any(a.name == "axis" for a in n.attribute)
               and model.opset_import[0].version < 13)
    assert all(name in result.float_reasons for _, name in result.float_nodes)
    assert result.verification.explained, result.verification
    fp32 = ort.InferenceSession(str(FP32), providers=["CPUExecutionProvider"]).run(None, {"x": images})[0].argmax(1)
    ours = ort.InferenceSession(str(result.path), providers=["CPUExecutionProvider"]).run(None, {"x": images})[0]
    theirs = ort.InferenceSession(str(qdq), providers=["CPUExecutionProvider"]).run(None, {"x": images})[0]
    assert (ours.argmax(1) == fp32).mean() >= (theirs.argmax(1) == fp32).mean() - 1 / 48
