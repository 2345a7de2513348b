"""PyTorch QAT export: the ONNX model computes what PyTorch does in onnxruntime, biases on the int32 grid, the
exporter's fallback, refusals."""

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from torch import nn

from recal_torch import ScheduledModifierManager, export_onnx, fake_quantize_model
from tests.support.onnx_graphs import assert_biases_on_grid
from tests.support.torch_models import SmallCNN, batches, train_steps
from tests.torch.qat_models import PaddedNet, _trained_qat_model


@pytest.fixture(scope="module")
def qat_model():
    return _trained_qat_model()


@pytest.mark.parametrize("dynamo", [True, False])
def test_qat_export_matches_pytorch_in_onnxruntime(qat_model, dynamo, tmp_path):
    path = export_onnx(qat_model, torch.randn(1, 1, 8, 8), tmp_path / "qat.onnx", dynamo=dynamo)
    model = onnx.load(str(path))
    onnx.checker.check_model(model)
    ops = [n.op_type for n in model.graph.node]
    assert "BatchNormalization" not in ops and ops.count("QuantizeLinear") >= 4
    # every Conv reads dequantized input and weight and feeds a QuantizeLinear (directly or via Relu)
    producers = {o: n for n in model.graph.node for o in n.output}
    consumers = {}
    for n in model.graph.node:
        for i in n.input:
            consumers.setdefault(i, []).append(n)
    def source(name):  # through ops that keep quantized values (runtimes propagate DQ over them)
        node = producers[name]
        while node.op_type in ("MaxPool", "Relu", "Reshape", "Flatten"):
            node = producers[node.input[0]]
        return node.op_type

    for conv in (n for n in model.graph.node if n.op_type == "Conv"):
        assert source(conv.input[0]) == "DequantizeLinear"
        assert producers[conv.input[1]].op_type == "DequantizeLinear"
        nxt = consumers[conv.output[0]][0]
        if nxt.op_type == "Relu":
            nxt = consumers[nxt.output[0]][0]
        assert nxt.op_type in ("QuantizeLinear",), nxt.op_type
    session = ort.InferenceSession(str(path))  # default optimization level
    x = torch.randn(1000, 1, 8, 8, generator=torch.Generator().manual_seed(3))
    got = session.run(None, {"input": x.numpy()})[0]
    with torch.no_grad():
        ref = qat_model(x).numpy()
    agreement = float((got.argmax(1) == ref.argmax(1)).mean())
    max_diff = float(np.abs(got - ref).max())
    print(f"dynamo={dynamo}: argmax agreement {agreement:.4f}, max abs diff {max_diff:.5f}")
    assert agreement >= 0.995
    assert list(tmp_path.iterdir()) == [path]


def test_float_export_keeps_pruned_zeros(tmp_path):
    from onnx import numpy_helper

    torch.manual_seed(0)
    model = SmallCNN()
    manager = ScheduledModifierManager.from_yaml("- !GradualKSModifier {params: [fc], init_sparsity: 0.5, "
                                                 "final_sparsity: 0.5, start_epoch: 0, end_epoch: 1, update_frequency: 1}")
    manager.modify(model, torch.optim.SGD(model.parameters(), lr=0.1), steps_per_epoch=1)
    model.eval()
    path = export_onnx(model, torch.randn(2, 1, 8, 8), tmp_path / "f.onnx", dynamo=False)
    weights = [numpy_helper.to_array(t) for t in onnx.load(str(path)).graph.initializer]
    fc = next(w for w in weights if w.shape == (10, 8))
    assert int((fc == 0).sum()) == 40
    session = ort.InferenceSession(str(path))
    x = torch.randn(5, 1, 8, 8)
    np.testing.assert_allclose(session.run(None, {"input": x.numpy()})[0], model(x).detach().numpy(), atol=1e-5)


def test_export_failure_leaves_no_file(tmp_path):
    class Broken(nn.Module):
        def forward(self, x):
            raise RuntimeError("boom")

    target = tmp_path / "m.onnx"
    with pytest.raises(Exception):
        export_onnx(Broken(), torch.randn(1, 2), target, dynamo=False)
    assert list(tmp_path.iterdir()) == []


def test_fresh_quantizers_pass_values_through_and_refuse_export(tmp_path):
    torch.manual_seed(0)
    model = SmallCNN()
    fake_quantize_model(model)
    model.eval()
    x = torch.randn(4, 1, 8, 8)
    reference = SmallCNN()
    torch.manual_seed(0)
    reference = SmallCNN().eval()
    # no observation yet: activations are not quantized (weights are), so outputs stay close to float
    assert torch.allclose(model(x), reference(x), atol=0.05)
    with pytest.raises(ValueError, match="has not observed any data"):
        export_onnx(model, x[:1], tmp_path / "m.onnx", dynamo=False)
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("dynamo", [True, False])
def test_export_writes_each_bias_on_the_int32_grid_of_its_layer(dynamo, tmp_path):
    """The int8 model holds a bias as ``round(bias / (s_x * s_w))`` in int32: the QAT export writes that value,
    so converting it adds no rounding (an off-grid bias flips output values near a rounding boundary, and on a
    deep net those flips travel). The input scale is found through the functional pad and the pool."""
    from recal_onnx import quantize_qat_export

    torch.manual_seed(0)
    model = PaddedNet()
    fake_quantize_model(model)
    train_steps(model, torch.optim.SGD(model.parameters(), lr=0.01), batches(4))
    model.eval()
    path = export_onnx(model, torch.randn(2, 1, 8, 8), tmp_path / "qat.onnx", dynamo=dynamo)
    found = assert_biases_on_grid(onnx.load(str(path)), 3)
    trained = [layer.folded_weight_and_bias()[1].detach().double().numpy() for layer in (model.c1, model.c2, model.fc)]
    moved = 0.0
    for (bias, step), float_bias in zip(found, trained):
        assert np.all(np.abs(bias - float_bias) <= 0.5 * step * (1 + 1e-3)), "moved by more than half a step"
        moved = max(moved, float(np.max(np.abs(bias - float_bias) / step)))
    assert moved > 0.01  # the trained biases sit between steps: the export did move them
    with torch.no_grad():  # the QAT model in PyTorch is still what the export computes, within a bias step
        x = torch.randn(64, 1, 8, 8, generator=torch.Generator().manual_seed(1))
        got = ort.InferenceSession(str(path)).run(None, {"input": x.numpy()})[0]
        assert (got.argmax(1) == model(x).numpy().argmax(1)).mean() >= 0.95
    result = quantize_qat_export(str(path), tmp_path / "int8.onnx", verify_inputs={"input": x.numpy()})
    v = result.verification
    assert v.argmax_agreement == 1.0 and v.max_abs_diff <= 1e-5 * v.output_range, v


def test_the_bias_grid_forgets_a_tensor_changed_in_place():
    """``out += identity`` changes a tensor that a quantize-dequantize had tagged: it is off that grid now."""
    from recal_torch.export.bias_grid import _GridTags

    tags = _GridTags()
    with tags:
        x = torch.fake_quantize_per_tensor_affine(torch.randn(4), 0.1, 0, 0, 255)
        y = torch.relu(x)
        assert tags.scale_of(x) == tags.scale_of(y) == pytest.approx(0.1)
        x += torch.full((4,), 0.033)
        assert tags.scale_of(x) is None and tags.scale_of(y) == pytest.approx(0.1)


def test_export_falls_back_to_the_other_exporter_and_says_why(tmp_path):
    """A forward the dynamo exporter cannot take (a branch on a tensor's value) is exported by TorchScript, with a
    warning naming the reason; a model neither exporter takes is one ExportError with both reasons, no file."""
    from recal_torch import ExportError, ExportWarning

    class Branchy(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 3)

        def forward(self, x):
            return self.fc(x) if float(x.sum()) > -1e9 else -self.fc(x)  # data-dependent: dynamo cannot trace it

    model = Branchy().eval()
    x = torch.randn(2, 4)
    with pytest.warns(ExportWarning, match=r"the dynamo exporter failed \(.*\); b.onnx was exported with the "
                                           r"TorchScript exporter \(dynamo=False\)"):
        path = export_onnx(model, x, tmp_path / "b.onnx")
    session = ort.InferenceSession(str(path))
    np.testing.assert_allclose(session.run(None, {"input": np.ones((5, 4), np.float32)})[0],
                               model(torch.ones(5, 4)).detach().numpy(), atol=1e-6)

    class Broken(nn.Module):
        def forward(self, x):
            raise RuntimeError("boom")

    with pytest.raises(ExportError, match=r"neither of torch's exporters exported Broken: the dynamo exporter "
                                          r"failed \(.*boom.*\); the TorchScript exporter failed \(.*boom"):
        export_onnx(Broken(), x, tmp_path / "broken.onnx")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b.onnx"]


def test_a_dynamic_batch_the_graph_cannot_run_is_caught_at_export(tmp_path):
    """A graph that fixes the sample's batch in a Reshape declares a dynamic batch it cannot run: the export runs
    the written model at one more row and, if it fails, uses the other exporter (or says both failed)."""
    from recal_torch import ExportError

    class Fixed(nn.Module):
        def forward(self, x):
            return x.reshape(2, 2, 2).sum((1, 2))  # written for a batch of 2 only

    with pytest.raises(ExportError, match=r"wrote a dynamic batch its graph cannot run \(at batch 3"):
        export_onnx(Fixed(), torch.randn(2, 4), tmp_path / "f.onnx", dynamo=False)
    assert not list(tmp_path.iterdir())
    path = export_onnx(Fixed(), torch.randn(2, 4), tmp_path / "g.onnx", dynamo=False, dynamic_batch=False)
    assert ort.InferenceSession(str(path)).run(None, {"input": np.ones((2, 4), np.float32)})[0].shape == (2,)


@pytest.mark.parametrize("bad", [-1.0, 0.0, float("nan")])
def test_a_scale_that_is_not_positive_and_finite_is_refused_at_export_naming_it(tmp_path, bad):
    """A learned scale set (or loaded) to -1, 0 or NaN after training: export refuses it by name and writes nothing
    (-1 would flip every sign it quantizes; 0 divides by zero inside torch). One so before ``finalize`` is held at
    float32's eps with a warning that names it, as after every step."""
    recipe = ("- !QuantizationModifier {start_epoch: 0, scheme: {input_activations: {symmetric: false, observer: "
              "lsq}, weights: {observer: lsq}}}\n")

    def trained():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))
        manager = ScheduledModifierManager.from_yaml(recipe)
        optimizer = manager.modify(model, torch.optim.SGD(model.parameters(), lr=1e-4), steps_per_epoch=4)
        for _ in range(2):
            optimizer.zero_grad()
            model(torch.randn(4, 8)).sum().backward()
            optimizer.step()
        return model, manager

    model, manager = trained()
    manager.finalize()
    with torch.no_grad():
        model.get_parameter("0.input_fake_quant.scale").fill_(bad)
    with pytest.raises(ValueError, match=r"0\.input_fake_quant\.scale is (-1|0|nan) .*positive and finite"):
        export_onnx(model, torch.randn(1, 8), tmp_path / "m.onnx")
    assert list(tmp_path.iterdir()) == []
    if bad == bad:  # not NaN: before finalize, the floor holds it and says so
        model, manager = trained()
        with torch.no_grad():
            model.get_parameter("2.weight_fake_quant.scale").fill_(bad)
        with pytest.warns(UserWarning, match=r"2\.weight_fake_quant\.scale"):
            manager.finalize()
        assert float(model.get_parameter("2.weight_fake_quant.scale").min()) > 0
        export_onnx(model, torch.randn(1, 8), tmp_path / "m.onnx")
