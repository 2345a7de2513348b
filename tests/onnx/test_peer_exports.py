"""The exports other tools wrote, committed under tests/fixtures/interop/ with the scripts that made them (Brevitas,
NNCF, ModelOpt, AIMET, torchao, Quark, TF Model Optimization, QONNX): every layer integer, or a refusal that names
what and why."""

import collections
import warnings
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from onnx import helper

from recal_onnx import ModelError, UnconvertedOpsWarning, quantize_qat_export
from recal_onnx.verify import generated_inputs
from tests.onnx.interop_graphs import (
    FIXTURE_DIR,
    FIXTURES,
    TRANSFORMER_FIXTURES,
    _float_weight_layers,
    _qonnx_layer,
    _reaches,
    _runtime_float_layers,
    _same_with_and_without_optimizations,
    ort_session,
)
from tests.support.onnx_graphs import QONNX_DOMAIN, Builder, aimet_layer, ops, qonnx_model, qonnx_quant, run


@pytest.mark.parametrize("path", FIXTURES, ids=[p.stem for p in FIXTURES])
def test_other_tools_exports_convert_with_every_layer_integer(path, tmp_path):
    """Each committed export of another tool (``scripts/interop_exports/``: Brevitas's QCDQ with int32 biases (and
    4-bit weights clipped to +-7: one file for every CPU, as AIMET's W4A8),
    NNCF's QDQ with its BatchNorms apart, ModelOpt's with only layer inputs quantized, torchao's PT2E with a dynamic
    batch, PyTorch's FX graph mode QAT converted to its quantized ops and exported by TorchScript, TF Model
    Optimization's through tf2onnx with its weights and BatchNorms folded into float kernels that lie
    on int8 grids, channels last): every Conv / Gemm / MatMul whose output a QuantizeLinear reads is integer (ModelOpt quantizes no residual
    add, torchao's x86 quantizer not the conv before one: those convs stay float, each with that reason, as
    onnxruntime's own fusion leaves them); verified on 256 samples, op by op within a step of the file run as
    written, the file left as it was."""
    before = path.read_bytes()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UnconvertedOpsWarning)
        result = quantize_qat_export(path, tmp_path / "int8.onnx")
    kinds = collections.Counter(ops(result.model))
    left = kinds["Conv"] + kinds["Gemm"] + kinds["MatMul"]
    assert left <= _runtime_float_layers(path, tmp_path), kinds  # never more float than onnxruntime's own fusion
    residual_float = path.stem.startswith(("modelopt", "torchao"))
    assert kinds["QLinearConv"] + left >= 12 and (left == 0) == (not residual_float), kinds
    convs = {n.name or f"Conv #{i}" for i, n in enumerate(onnx.load(path).graph.node) if n.op_type == "Conv"}
    assert all("not by one QuantizeLinear alone" in why for name, why in result.float_reasons.items()
               if name in convs or name.endswith("Conv")), result.float_reasons
    assert len(result.grid_weights) == (13 if path.stem.startswith("tfmot") else 0), result.grid_weights
    assert (result.avx2_path is None) == ("w4" in path.stem), result.weights_note  # 4-bit weights: one file
    v = result.verification
    # class ids: random weights leave 1-5% of the samples within a step of a tie (torchao's: onnxruntime's own
    # fusion flips 2 of 256, recal's 3, every integer tensor within a step; tfmot's: generated inputs, far from its
    # training data, leave its logits near ties, and a default session of the file itself agrees on 96.5%)
    assert v.samples >= 256 and v.local_steps <= 1 and v.local_share <= 1e-3 and v.argmax_agreement >= 0.95, v
    assert path.read_bytes() == before


@pytest.mark.parametrize("name", ["tfmot-mobilenetv2", "tflite-mobilenetv2"])
def test_tensorflows_keras_applications_mobilenetv2_converts_with_every_layer_integer(name, tmp_path):
    """keras.applications' own MobileNetV2 (depthwise convs, ReLU6, stride-2 blocks behind ZeroPadding2D) through
    TF Model Optimization's QAT (``scripts/interop_exports/tfmot_export.py``), by tf2onnx (its 53 float kernels,
    weight quantizers and BatchNorms folded, read back from their int8 grids, the pads folded into the convs first)
    and as TFLite's integer model (int8 activations with zero points): every conv and the classifier integer,
    verified on 256 samples within a step op by op, the file left as it was."""
    path = FIXTURE_DIR / f"{name}.onnx"
    before = path.read_bytes()
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnconvertedOpsWarning)
        result = quantize_qat_export(path, tmp_path / "int8.onnx")
    kinds = collections.Counter(ops(result.model))
    assert kinds["QLinearConv"] == 52 and kinds["QGemm"] == 1, kinds
    assert kinds["Conv"] == kinds["Gemm"] == kinds["MatMul"] == 0, kinds
    assert len(result.grid_weights) == (53 if name.startswith("tfmot") else 0), result.grid_weights
    v = result.verification
    assert v.samples >= 256 and v.local_steps <= 1 and v.local_share <= 1e-3, v
    assert path.read_bytes() == before


@pytest.mark.parametrize("path", TRANSFORMER_FIXTURES, ids=[p.stem for p in TRANSFORMER_FIXTURES])
def test_other_tools_transformer_exports_convert_every_weight_layer(path, tmp_path):
    """A Hugging Face BERT quantized by another tool (``scripts/interop_exports/*_bert_export.py``: ModelOpt's
    quantized Linear inputs, NNCF's transformer preset with its attention's Q·Kᵀ, SmoothQuant scales and int8
    embedding tables, torchao's PT2E with its int8 weights stored as integers, Brevitas's layerwise QCDQ with its
    initializers listed as graph inputs too, AIMET's with its ops' outputs quantized): every Linear becomes an integer
    matmul (or, where the tool left its input float, int8 weights in MatMulNBits, with the reason), an attention
    product whose two inputs the tool quantized too, the others stay float (two float
    activations, no weight: as onnxruntime's own fusion leaves them), the embedding tables int8 where the tool
    quantized them; verified on 256 samples within a step op by op of the file run as written, the file left as it
    was."""
    before = path.read_bytes()
    source = onnx.load(path)
    linears = _float_weight_layers(source)
    assert len(linears) == 14  # 12 encoder Linears, pooler, classifier
    products = [n for n in source.graph.node if n.op_type == "MatMul" and n.name not in linears]
    quantized = [n for n in products if all(_reaches(source, x, ("DequantizeLinear",)) for x in n.input)]
    assert len(products) == 4 and len(quantized) == (2 if path.stem.startswith(("nncf", "aimet")) else 0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UnconvertedOpsWarning)
        result = quantize_qat_export(path, tmp_path / "int8.onnx")
    kinds = collections.Counter(ops(result.model))
    assert _float_weight_layers(result.model) == [], kinds
    integer = kinds["MatMulIntegerToFloat"] + kinds["QGemm"] + kinds["QLinearMatMul"]
    assert integer + kinds["MatMulNBits"] == 14 + len(quantized), kinds
    # a Linear whose input the tool left float (AIMET's attention output, after its float P·V) keeps int8 weights,
    # computed in float, and says why
    nbits = [n.name for n in result.model.graph.node if n.op_type == "MatMulNBits"]
    assert len(nbits) == (2 if path.stem.startswith("aimet") else 0), kinds
    assert all("is float" in result.float_reasons[name] for name in nbits), result.float_reasons
    assert kinds["MatMul"] == len(products) - len(quantized), kinds
    if path.stem.startswith("nncf"):  # its int8 tables, read as int8 and scaled by row
        assert sum(n.op_type == "Gather" and n.name.endswith("_int8") for n in result.model.graph.node) == 3
    v = result.verification
    assert v.samples >= 256 and v.local_steps <= 1 and v.local_share <= 1e-3 and v.argmax_agreement >= 0.99, v
    floats = sum(t.data_type == onnx.TensorProto.FLOAT and np.prod(t.dims) > 4096 for t in source.graph.initializer)
    ratio = (tmp_path / "int8.onnx").stat().st_size / path.stat().st_size
    # ModelOpt and NNCF store float weights; torchao and Brevitas int8 ones, and their rows of the constant position
    # and token-type tables are gathered once (4096 floats where a 256-float table was)
    assert ratio < (0.4 if floats > 14 else 1.05), ratio
    assert path.read_bytes() == before


def test_modelopts_onnx_int4_awq_export_becomes_matmulnbits_exactly(tmp_path):
    """NVIDIA ModelOpt's ONNX INT4 quantizer (AWQ, its path for LLMs; ``scripts/interop_exports/
    modelopt_onnx_export.py``) on a trained BERT: every MatMul it quantized (int4 blocks of 128 along K) becomes
    ``MatMulNBits`` at those blocks, verified on 256 samples within float rounding, the file left as it was. At its
    defaults it also quantizes the pooler's and classifier's Gemm (transB=1) with scales in blocks along K but axis 0
    written, a file onnxruntime refuses: refused before any work, by node, with the axis that fits."""
    path = FIXTURE_DIR / "modelopt-int4-awq-bert.onnx"
    before = path.read_bytes()
    blocked = [n for n in onnx.load(path).graph.node if n.op_type == "DequantizeLinear"
               and any(a.name == "block_size" and a.i == 128 for a in n.attribute)]
    assert len(blocked) == 12  # two layers' six Linears
    result = quantize_qat_export(path, tmp_path / "int4.onnx")
    nbits = [n for n in result.model.graph.node if n.op_type == "MatMulNBits"]
    assert len(nbits) == 12 and "DequantizeLinear" not in ops(result.model), collections.Counter(ops(result.model))
    assert all({(a.name, a.i) for a in n.attribute} >= {("bits", 4), ("block_size", 128)} for n in nbits)
    v = result.verification
    assert v.samples >= 256 and v.argmax_agreement == 1.0 and v.max_abs_diff <= 1e-5 * v.output_range, v
    assert path.read_bytes() == before
    wrong_axis = FIXTURE_DIR / "refused" / "modelopt-int4-awq-bert-gemm.onnx"
    with pytest.raises(ModelError, match=r"blocks of 128 along axis 0, which needs \[1, 128\]; that scale gives "
                                         r"blocks along axis 1, the K axis of the Gemm \(transB=1\)"):
        quantize_qat_export(wrong_axis, tmp_path / "refused.onnx")
    assert not (tmp_path / "refused.onnx").exists()


@pytest.mark.parametrize("name, quantized, floats", [
    ("modelopt-onnx-int8-bert", 16, 0), ("modelopt-onnx-int8-resnet", 12, 4),
    ("modelopt-onnx-int8-fp16-bert", 16, 0), ("modelopt-onnx-int8-fp16-resnet", 12, 4),
    ("nncf-onnx-int8-bert", 16, 0), ("nncf-onnx-int8-resnet", 12, 0),
    ("quark-xint8-bert", 18, 0), ("quark-xint8-resnet", 13, 0),
    ("quark-a8w8-bert", 18, 0), ("quark-a8w8-resnet", 13, 0)])
def test_onnx_quantizers_exports_convert_with_every_quantized_layer_integer(name, quantized, floats, tmp_path):
    """What other tools' post-training quantizers of ONNX files write (``scripts/interop_exports/``: NVIDIA
    ModelOpt's ONNX INT8 quantization, NNCF's ONNX backend with its transformer preset, AMD Quark's XINT8 with its
    int8 biases on power-of-two grids and its A8W8 in onnxruntime's com.microsoft Q/DQ): every MatMul / Conv / Gemm
    whose inputs they quantized is integer (the BERTs' Linears and the attention products they quantized; ModelOpt's
    files at its default ``high_precision_dtype="fp16"`` compute in float16, and in float32 once converted), but
    ModelOpt's ResNet convs before a residual add, whose outputs it did not quantize: float with that reason, as
    onnxruntime's own fusion leaves them. Layers a tool left unquantized (ModelOpt's classifiers, too small for it)
    stay as written; verified on 256 samples, op by op within a step of the file run as written."""
    path = FIXTURE_DIR / f"{name}.onnx"
    source = onnx.load(path)
    layers = [n for n in source.graph.node if n.op_type in ("Conv", "MatMul", "Gemm")
              and all(_reaches(source, x, ("DequantizeLinear",)) for x in n.input[:2])]
    assert len(layers) == quantized
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UnconvertedOpsWarning)
        result = quantize_qat_export(path, tmp_path / "int8.onnx")
    kinds = collections.Counter(ops(result.model))
    integer = kinds["MatMulIntegerToFloat"] + kinds["QLinearMatMul"] + kinds["QLinearConv"] + kinds["QGemm"]
    assert kinds["Conv"] == floats and integer >= quantized - floats, kinds  # (a Gemm past a Flatten: integer too)
    assert kinds["Conv"] <= _runtime_float_layers(path, tmp_path), kinds  # never more than onnxruntime's own fusion
    assert all("not by one QuantizeLinear alone" in why for node, why in result.float_reasons.items()
               if node.endswith("Conv")), result.float_reasons
    v = result.verification
    assert v.samples >= 256 and v.local_steps <= 1 and v.local_share <= 1e-3 and v.argmax_agreement >= 0.98, v


def test_nncfs_openvino_export_is_refused_with_the_way_to_qdq():
    b = Builder()
    y = b.node("FakeQuantize", ["x", b.const(np.float32(-1)), b.const(np.float32(1)), b.const(np.float32(-1)),
                                b.const(np.float32(1))], domain="org.openvinotoolkit", levels=256)
    model = b.model([("x", [1, 4])], [b.qdq(y, 0.1, 128)])
    model.opset_import.append(helper.make_opsetid("org.openvinotoolkit", 1))
    with pytest.raises(ModelError, match="FakeQuantize \\(org.openvinotoolkit\\).*nncf.strip"):
        quantize_qat_export(model)


def test_aimets_w4a8_export_converts_on_finer_weight_grids_and_its_a16w8_is_refused(tmp_path):
    """AIMET at ``default_param_bw=4`` quantizes each float weight with a QuantizeLinear to int4 and keeps its
    BatchNorms apart: folded into the convs, their biases fall between int32 steps of a 4-bit weight's scale, which
    moved 0.5% of the integers by a step (refused). Held on a grid 8 times finer (the same weights, within +-64) every
    layer is integer, one file exact on every CPU. At ``default_output_bw=16`` every activation is 16-bit: refused,
    saying so (``scripts/interop_exports/aimet_export.py``)."""
    result = quantize_qat_export(FIXTURE_DIR / "aimet-w4a8-small-resnet.onnx", tmp_path / "int8.onnx")
    kinds = collections.Counter(ops(result.model))
    assert kinds["QLinearConv"] == 12 and "Conv" not in kinds and result.rewrites["finer_weight_grids"] == 12, kinds
    assert result.avx2_path is None and "none saturates" in result.weights_note
    assert result.verification.local_share <= 1e-3 and result.verification.local_steps <= 1, result.verification
    with pytest.raises(ModelError, match=r"every activation is quantized to 16 bits \(uint16"):
        quantize_qat_export(FIXTURE_DIR / "refused" / "aimet-a16w8-small-resnet.onnx", tmp_path / "a16.onnx")
    assert not (tmp_path / "a16.onnx").exists()


@pytest.mark.parametrize("name, qcdq", [("brevitas-qonnx-small-resnet", "brevitas-small-resnet"),
                                        ("brevitas-qonnx-dynamo-small-resnet", "brevitas-small-resnet"),
                                        ("brevitas-qonnx-w4-small-resnet", "brevitas-w4-small-resnet"),
                                        ("brevitas-qonnx-small-bert", "brevitas-small-bert")])
def test_brevitas_qonnx_exports_convert_to_what_their_qcdq_exports_convert_to(name, qcdq, tmp_path):
    """Brevitas's ``export_qonnx`` (QONNX's ``Quant``, a domain onnxruntime cannot run) of the model its QCDQ fixture
    holds: the ResNet at 8 bits (by TorchScript, and by its dynamo path: opset 20, initializers and weights' slices
    listed as graph inputs) and with 4-bit weights per channel, the BERT quantized layer by layer, its initializers
    listed as graph inputs too (``scripts/interop_exports/brevitas_export.py``, ``brevitas_bert_export.py``). Read as
    the QCDQ it means: every layer integer, verified on 256 samples against that reading, no input but the model's
    own, and the converted model computes exactly what the QCDQ export's conversion computes, with the same integer
    ops (``scripts/interop_exports/qonnx_check.py`` checks the reading against qonnx's own executor)."""
    path = FIXTURE_DIR / f"{name}.onnx"
    before = path.read_bytes()
    result = quantize_qat_export(path, tmp_path / "int8.onnx")
    twin = quantize_qat_export(FIXTURE_DIR / f"{qcdq}.onnx", tmp_path / "qcdq.int8.onnx")
    kinds = collections.Counter(ops(result.model))

    def integer(model):
        return {op: n for op, n in collections.Counter(ops(model)).items()
                if op.startswith(("QLinear", "QGemm", "MatMulInteger"))}

    assert integer(result.model) == integer(twin.model), kinds
    assert kinds["QGemm"] + kinds["QLinearConv"] == (14 if "bert" in name else 13), kinds
    assert not result.unconverted and "Quant nodes are read as the QuantizeLinear" in result.notes[0]
    assert len(result.model.graph.input) == 1  # the model's own: initializers listed beside it are constants
    assert (result.avx2_path is None) == ("w4" in name), result.weights_note
    v = result.verification
    assert v.samples >= 256 and v.local_steps <= 1 and v.local_share <= 1e-3, v
    _same_with_and_without_optimizations(result.model)
    ours, theirs = (ort_session(r.model) for r in (result, twin))
    for seed in range(32):
        (x,) = generated_inputs(result.model, 1, seed=seed).values()  # (the exports name the input differently)
        np.testing.assert_array_equal(ours.run(None, {ours.get_inputs()[0].name: x})[0],
                                      theirs.run(None, {theirs.get_inputs()[0].name: x})[0])
    assert path.read_bytes() == before


@pytest.mark.parametrize("legacy", [False, True], ids=["1.0.0", "0.6.1"])
def test_a_float_model_with_aimets_encodings_converts_to_what_they_mean(legacy, tmp_path):
    """AIMET's ``QuantizationSimModel.export``: the float model and its encodings (both layouts). The converted model
    is integer and computes what AIMET's simulation means, ``x = (q + offset) * scale`` with ``q`` clamped to
    ``[0, 255]``, computed here by torch's fake quantizers (zero point ``-offset``), within one output step."""
    model, encodings, w = aimet_layer(legacy)
    result = quantize_qat_export(model, tmp_path / "int8.onnx", encodings=encodings)
    assert ops(result.model).count("QLinearConv") == 1 and not result.unconverted, ops(result.model)
    assert "AIMET encodings: 2 activations quantized and 1 parameters" in result.notes[0]
    x = torch.from_numpy(np.random.default_rng(1).standard_normal((2, 3, 6, 6)).astype(np.float32))
    weight = torch.tensor(onnx.numpy_helper.to_array(next(t for t in model.graph.initializer if t.name == w)))
    fq_x = torch.fake_quantize_per_tensor_affine(x, 0.03, 120, 0, 255)
    fq_w = torch.fake_quantize_per_channel_affine(weight, torch.tensor([0.004, 0.005, 0.0045, 0.006]),
                                                  torch.full((4,), 128, dtype=torch.int32), 0, 0, 255)
    # (torch's per-channel form takes the unsigned grid too: zero point 128 is AIMET's offset -128)
    want = torch.fake_quantize_per_tensor_affine(torch.relu(torch.nn.functional.conv2d(fq_x, fq_w, padding=1)),
                                                 0.02, 0, 0, 255).numpy()
    got = run(result.model, {"x": x.numpy()})[0]
    assert np.abs(got - want).max() <= 0.02 + 1e-6 and np.mean(got != want) < 0.01


@pytest.mark.parametrize("changes, message", [
    ({"name": "nothing"}, r"the encodings name tensor 'nothing', which the model does not have"),
    ({"offset": [-128] * 3}, r"param_encodings entry 'w\d+': 4 scales and 3 offsets"),
    ({"offset": [-300] * 4}, r"param_encodings entry 'w\d+': offset \[-300, -300, -300, -300\] is not an integer in "
                             r"\[-255, 0\]"),
    ({"scale": [0.004, 0.0, 0.1, 0.1]}, r"scale \[0.004, 0.0, 0.1, 0.1\] is not finite and positive"),
    ({"bw": "eight"}, r"param_encodings, tensor 'w\d+', field 'bw': Input should be a valid integer"),
    ({"enc_type": "PER_BLOCK"}, r"field 'enc_type': Input should be 'PER_TENSOR' or 'PER_CHANNEL'"),
    ({"scale": [0.004] * 3, "offset": [-128] * 3}, r"parameter 'w\d+' of shape \[4, 3, 3, 3\] has 3 per-channel "
                                                   r"encodings, and its readers do not tell along which axis"),
], ids=["name", "counts", "offset", "scale", "type", "blocks", "axis"])
def test_aimets_encodings_that_do_not_fit_are_refused_by_name(changes, message, tmp_path):
    """Encodings that name a tensor the model lacks, or hold values AIMET's grid cannot mean: refused before any
    work, naming the section, the tensor and the field, nothing written."""
    model, encodings, _ = aimet_layer(**changes)
    with pytest.raises(ModelError, match=message):
        quantize_qat_export(model, tmp_path / "int8.onnx", encodings=encodings)
    assert not list(tmp_path.iterdir())


def test_aimets_encodings_files_that_are_not_its_own_are_refused(tmp_path):
    """Not JSON, another version's layout, and encodings beside a model that is already QDQ: each refused, saying
    so; a float model without its encodings is told that it can bring them."""
    model, encodings, _ = aimet_layer()
    bad = tmp_path / "bad.encodings"
    bad.write_text("{not json")
    with pytest.raises(ModelError, match=r"bad.encodings: not a JSON encodings file"):
        quantize_qat_export(model, encodings=bad)
    with pytest.raises(ModelError, match=r"encodings version 2.0.0; the converter reads versions up to 0.6.1 and "
                                         r"1.0.0, .* aimet_torch.onnx.export, whose QDQ model converts"):
        quantize_qat_export(model, encodings={**encodings, "version": "2.0.0"})
    legacy = aimet_layer(legacy=True)[1]
    del legacy["activation_encodings"]["x"][0]["scale"]
    with pytest.raises(ModelError, match=r"activation_encodings\['x'\]: an integer encoding without its scale"):
        quantize_qat_export(model, encodings=legacy)
    with pytest.raises(ModelError, match=r"is not a QAT model: .* converts with its encodings: encodings="):
        quantize_qat_export(model)
    with pytest.raises(ModelError, match=r"is already quantized .* AIMET's encodings go with the float model"):
        quantize_qat_export(FIXTURE_DIR / "aimet-small-resnet.onnx", encodings=encodings)


@pytest.mark.parametrize("name", ["aimet-sim-small-resnet", "aimet-sim-small-bert"])
def test_aimets_sim_export_converts_with_every_layer_integer(name, tmp_path):
    """AIMET's classic QAT export (``sim.export``: the float model, the ResNet with its BatchNorms, and its
    ``.encodings``; ``scripts/interop_exports/aimet_export.py`` and ``aimet_bert_export.py``, which check recal's
    reading against AIMET's simulation itself): every layer integer (the BatchNorms folded into the integer convs;
    the BERT's Linears integer matmuls but the attention output's, whose input AIMET leaves float after its float
    P·V: int8 weights in MatMulNBits, as from its QDQ export), verified on 256 samples within a step op by op of what
    the encodings mean; the CLI takes the same files with ``--encodings``."""
    from recal_app.cli import main

    path = FIXTURE_DIR / f"{name}.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UnconvertedOpsWarning)
        result = quantize_qat_export(path, tmp_path / "int8.onnx", encodings=path.with_suffix(".encodings"))
    kinds = collections.Counter(ops(result.model))
    if "bert" in name:
        assert kinds["MatMulIntegerToFloat"] == 12 and kinds["MatMulNBits"] == 2 and "Gemm" not in kinds, kinds
        assert _float_weight_layers(result.model) == []
    else:
        assert kinds["QLinearConv"] == 12 and kinds["QGemm"] == 1 and kinds["QLinearAdd"] == 4, kinds
        assert "BatchNormalization" not in kinds and not result.unconverted
    _same_with_and_without_optimizations(result.model)
    v = result.verification
    assert v.samples >= 256 and v.local_steps <= 1 and v.local_share <= 1e-3, v
    assert main(["quantize-qat-export", str(path), str(tmp_path / "cli.onnx"), "--encodings",
                 str(path.with_suffix(".encodings"))]) == 0


@pytest.mark.parametrize("overrides, message", [
    ({"scale": "s"}, r"its scale is computed at run time \(dynamic quantization\), not a constant"),
    ({"bits": 16}, r"an activation quantized to 16 bits; onnxruntime's integer kernels take 8"),
    ({"bits": 1}, r"bit width \[1.0\], expected one integer from 2 to 32 \(1 bit is QONNX's BipolarQuant"),
    ({"rounding_mode": "FLOOR"}, r"an activation rounded FLOOR; QuantizeLinear rounds half to even"),
    ({"rounding_mode": "STOCHASTIC"}, r"rounding mode 'STOCHASTIC', expected one of ROUND"),
    ({"zero_point": 0.5}, r"zero point \[0.5\] is not an integer"),
    ({"zero_point": 200}, r"zero point \[200.0\] is outside its range \[-128, 127\]"),
    ({"scale": np.full((1, 3, 6, 1), 0.05)}, r"scale and zero point of shape \[1, 3, 6, 1\] vary along several axes"),
    ({"scale": -0.05}, r"its scale holds values that are not finite and positive"),
    ({"scale": np.full((1, 5, 1, 1), 0.05)}, r"scale and zero point of shape \[1, 5, 1, 1\] do not broadcast over "
                                             r"its input 'x' of shape \[2, 3, 6, 6\]"),
    ({"narrow": None}, r"'narrow' is not set, and QONNX's specification \(0\) and its implementation \(1\)"),
], ids=["dynamic", "16-bit", "1-bit", "floor", "unknown-mode", "fractional-zp", "zp-range", "two-axes", "negative",
        "no-broadcast", "no-narrow"])
def test_a_qonnx_quantizer_with_no_qdq_form_is_refused_by_name(overrides, message, tmp_path):
    """What QONNX can say and QuantizeLinear / DequantizeLinear cannot: refused before any work, naming the file, the
    node and the value, nothing written; the same layer at its defaults converts."""
    with pytest.raises(ModelError, match=r"the model: QONNX Quant 'Quant\d+': " + message):
        quantize_qat_export(_qonnx_layer(**overrides), tmp_path / "int8.onnx")
    assert not list(tmp_path.iterdir())
    result = quantize_qat_export(_qonnx_layer(), tmp_path / "ok.onnx")
    assert ops(result.model).count("QLinearConv") == 1 and not result.unconverted


def test_qonnx_ops_with_no_integer_kernel_are_refused_with_what_is_read():
    """QONNX's Trunc (Brevitas's TruncAvgPool) has no QDQ form: refused naming it, saying that its Quant is read."""
    b = Builder()
    x = qonnx_quant(b, "x", 0.05, 0, 8)
    y = b.node("Trunc", [x, b.const(np.float32(0.05)), b.const(np.float32(0)), b.const(np.float32(8)),
                         b.const(np.float32(4))], domain=QONNX_DOMAIN)
    with pytest.raises(ModelError, match=r"Trunc \(qonnx.custom_op.general\); this is QONNX, whose integer Quant the "
                                         r"converter reads, but not its Trunc"):
        quantize_qat_export(qonnx_model(b, [("x", [2, 3])], [(y, [2, 3])]))


def test_the_export_scripts_models_build_beside_torch_alone(monkeypatch):
    """``scripts/interop_exports/common.py`` runs in each peer tool's venv, so nothing in CI imports it otherwise:
    its models build, and its text batches are windows of real source labelled by their module."""
    monkeypatch.syspath_prepend(str(Path(__file__).parents[2] / "scripts" / "interop_exports"))
    common = __import__("common")
    torch.manual_seed(0)
    assert common.SmallResNet()(torch.randn(2, 3, common.SIZE, common.SIZE)).shape == (2, common.CLASSES)
    (ids, labels), = common.text_batches(1, batch=3)
    assert ids.shape == (3, common.TOKENS) and int(ids.max()) < 256 and labels.shape == (3,)
    assert common.small_bert().eval()(ids).shape == (3, common.TEXT_CLASSES)
