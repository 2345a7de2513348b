"""The PyTorch QAT planner: ignore and scheme overrides, call sites (shared ReLUs, residual adds, SiLUs,
concatenations), what stays float and the warning that names it."""

import numpy as np
import onnxruntime as ort
import pytest
import torch
from torch import nn

from recal_torch import QATConv, QATLinear, ScheduledModifierManager, export_onnx, fake_quantize_model
from recal_torch.qat import ActivationFakeQuantize
from tests.support.torch_models import SmallCNN, batches, train_steps
from tests.torch.qat_models import (
    CompiledBlock,
    ConcatBlock,
    FunctionalActivations,
    InlineModules,
    InvertedResidual,
    LibrarySiLU,
    MBConvLike,
    SharedConv,
    SharedReLU,
    SqueezeExcite,
    Untraceable,
    _int8,
    _qat_with,
)


def test_ignore_leaves_named_layers_and_classes_float_and_the_next_layer_quantizes_its_input():
    model = _qat_with("[conv1]", "null")
    assert type(model.conv1) is nn.Conv2d and type(model.bn1) is nn.BatchNorm2d and type(model.relu1) is nn.ReLU
    assert isinstance(model.conv2, QATConv) and isinstance(model.conv3, QATConv)
    assert model.conv2.input_fake_quant is not None  # its input no longer comes from a quantized layer
    model = _qat_with("[Linear]", "null")
    assert type(model.fc) is nn.Linear and isinstance(model.conv1, QATConv)
    model = _qat_with("[Conv2d]", "{Linear: {input_activations: null, weights: null}}")
    assert not any(isinstance(m, (QATConv, QATLinear)) for m in model.modules())


def test_ignore_and_scheme_overrides_take_re_patterns_of_module_names():
    """llm-compressor's spelling (``ignore: ['re:.*lm_head']``): a pattern matches a module's whole name or a
    parent's; one that cannot compile is a located error at load."""
    from recal_core import RecipeError

    model = _qat_with("['re:conv[12]']", "null")
    assert type(model.conv1) is nn.Conv2d and type(model.conv2) is nn.Conv2d and isinstance(model.conv3, QATConv)
    model = _qat_with("null", "{'re:f.': {input_activations: null, weights: null}}")
    assert type(model.fc) is nn.Linear and isinstance(model.conv1, QATConv)
    with pytest.warns(UserWarning, match=r"ignore entry 're:conv' names no module"):  # a whole name, not a prefix
        _qat_with("['re:conv']", "null")
    with pytest.raises(RecipeError, match=r"<string>:5:\d+: .*ignore.*'re:\(conv': invalid regular expression"):
        _qat_with("['re:(conv']", "null")
    with pytest.raises(RecipeError, match=r"scheme_overrides.*'re:\(\?:a\{2000\}\)\{2000\}'.*unroll"):
        _qat_with("null", "{'re:(?:a{2000}){2000}': {weights: null}}")


def test_scheme_overrides_recal_cannot_honour_are_located_errors_and_unused_entries_warn():
    from recal_core import RecipeError

    with pytest.raises(RecipeError, match=r"<string>:6:\d+: .*'scheme_overrides'.*'Conv2d'.*symmetric per channel"):
        _qat_with("null", "{Conv2d: {weights: {symmetric: false}}}")
    with pytest.raises(RecipeError, match=r"some tensors float and others quantized"):
        _qat_with("null", "{fc: {weights: null}}")
    with pytest.warns(UserWarning, match=r"ignore entry 'LlamaRMSNorm' names no module"):
        _qat_with("[LlamaRMSNorm]", "null")
    model = nn.Sequential(nn.Embedding(10, 8), nn.Flatten(), nn.Linear(16, 4))
    with pytest.raises(RecipeError, match=r"'Embedding' \(0\).*embedding tables other than symmetric 8 or 4 bits per row"):
        _qat_with("null", "{Embedding: {input_activations: null, weights: {num_bits: 8, symmetric: false}}}", model)
    model = nn.Sequential(nn.Embedding(10, 8), nn.Flatten(), nn.Linear(16, 4))
    _qat_with("null", "{Embedding: {weights: null}}", model)  # the table stays float, the Linear quantizes
    assert type(model[0]) is nn.Embedding and isinstance(model[2], QATLinear)
    model = nn.Sequential(nn.LayerNorm(4), nn.Linear(4, 2))
    with pytest.warns(UserWarning, match=r"asks to quantize LayerNorm, which recal's QAT leaves float"):
        _qat_with("null", "{LayerNorm: {input_activations: {num_bits: 8}}}", model)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    _qat_with("null", "{ReLU: {input_activations: null, output_activations: null}}", model)  # consistent: silent
    assert isinstance(model[0], QATLinear)


def test_a_shared_relu_gets_an_observer_per_call_site(tmp_path):
    torch.manual_seed(0)
    model = SharedReLU()
    fake_quantize_model(model)
    assert model.conv1.relu and isinstance(model.relu, nn.ReLU)  # fused into conv1; the module stays (idempotent)
    result = _int8(model, tmp_path)
    assert list(model.recal_sites) == ["relu:forward:1"]  # the second call, after the add, has its own observer
    kinds = [n.op_type for n in result.model.graph.node]
    assert kinds.count("QLinearAdd") == 1 and kinds.count("QLinearConv") == 2 and not result.float_nodes, kinds
    assert "Relu" not in kinds and result.verification.max_steps <= 3


def test_a_shared_conv_is_named_in_a_warning():
    from recal_torch.qat import QATPlanWarning

    class SharedConv(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(4, 4, 3, padding=1)

        def forward(self, x):
            return self.conv(self.conv(x))

    with pytest.warns(QATPlanWarning, match=r"'conv' \(2 calls\).*give each call its own module"):
        fake_quantize_model(SharedConv())


@pytest.mark.parametrize("kind", [InvertedResidual, Untraceable], ids=["traced", "untraceable"])
def test_a_residual_add_without_activation_is_quantized_once(kind, tmp_path, caplog):
    torch.manual_seed(0)
    model = kind()
    with caplog.at_level("INFO", logger="recal_torch.qat.plan"):
        fake_quantize_model(model)
        result = _int8(model, tmp_path)
    assert sorted(model.recal_sites) == [":add:0", ":add:1"]  # both sums, each read by a conv and the next add
    assert all(isinstance(b[3], QATConv) and b[3].folded_bn is not None for b in model.blocks)
    assert model.stem[0].relu6 and isinstance(model.stem[2], nn.Identity)
    assert all(b[0].input_fake_quant is None or not b[0].input_fake_quant.active for b in model.blocks)
    kinds = [n.op_type for n in result.model.graph.node]
    assert kinds.count("QLinearAdd") == 2 and kinds.count("QLinearConv") == 5 and not result.float_nodes, kinds
    if kind is Untraceable:  # a linear whose output no quantized layer reads returns float there
        assert "plan from the first forward" in caplog.text and result.verification.max_steps is None
        assert result.verification.max_abs_diff <= 0.02 * result.verification.output_range
    else:
        assert result.verification.max_steps <= 3


def test_an_add_in_a_module_that_calls_a_stranger_stays_float_and_is_named():
    """A module that calls another module's child: its own calls cannot be told from that child's, so the sum
    gets no observer (a wrong call would be quantized otherwise), and the warning names the module."""

    class Borrower(nn.Module):
        def __init__(self, lender):
            super().__init__()
            object.__setattr__(self, "lender", lender)  # not a child: the lender's module
            self.conv = nn.Conv2d(4, 4, 1)

        def forward(self, x):
            return self.conv(x) + self.lender.blocks[0](x)

    class Net(InvertedResidual):
        def __init__(self):
            super().__init__()
            self.borrower = Borrower(self)

        def forward(self, x):
            return self.fc(torch.flatten(torch.nn.functional.adaptive_avg_pool2d(self.borrower(self.stem(x)), 1), 1))

    torch.manual_seed(0)
    model = Net()
    from recal_torch.qat import QATPlanWarning

    fake_quantize_model(model)
    with pytest.warns(QATPlanWarning, match=r"residual add in 'borrower' stays float.*\(blocks\.0\)"):
        model(torch.randn(2, 1, 8, 8))
    assert "recal_sites" not in model._modules


def test_call_site_observers_travel_in_checkpoints(tmp_path):
    torch.manual_seed(0)
    model = Untraceable()
    fake_quantize_model(model)
    train_steps(model, torch.optim.SGD(model.parameters(), lr=0.01), batches(2))
    state = model.state_dict()
    assert any(k.startswith("recal_sites.") for k in state)
    torch.manual_seed(1)
    fresh = Untraceable()
    fake_quantize_model(fresh)
    fresh.load_state_dict(state)  # before its first forward: the observers are created from the checkpoint
    fresh.eval(), model.eval()
    x = torch.randn(4, 1, 8, 8)
    torch.testing.assert_close(fresh(x), model(x))


def test_functional_relu_and_relu6_fold_into_the_range_before_them(tmp_path):
    from recal_onnx import quantize_qat_export

    torch.manual_seed(0)
    model = FunctionalActivations()
    fake_quantize_model(model)
    assert model.c1.relu and not model.c1.relu6 and model.c2.relu6 and model.c3.relu6
    assert isinstance(model.act2, nn.Identity)  # the module is fused; a function stays (idempotent after the clamp)
    assert model.c1.input_fake_quant is not None
    assert model.c2.input_fake_quant is None and model.c3.input_fake_quant is None and model.fc.input_fake_quant is None
    train_steps(model, torch.optim.SGD(model.parameters(), lr=0.01), batches(4))
    model.eval()
    for fq in model.modules():
        if isinstance(fq, ActivationFakeQuantize):
            fq.observer_enabled = False
    assert float(model.c2.activation_post_process.max_val) <= 6.0 and int(model.c2.activation_post_process.zero_point) == 0
    path = export_onnx(model, torch.randn(1, 1, 8, 8), tmp_path / "qat.onnx", dynamo=False)
    result = quantize_qat_export(str(path), tmp_path / "int8.onnx")
    kinds = [n.op_type for n in result.model.graph.node]
    assert kinds.count("QLinearConv") == 3 and kinds.count("QGemm") == 1 and not result.float_nodes
    assert "Relu" not in kinds and "Clip" not in kinds and result.verification.max_steps <= 3


def test_a_concat_of_quantized_branches_converts_to_integers(tmp_path):
    from recal_onnx import quantize_qat_export

    torch.manual_seed(0)
    model = ConcatBlock()
    fake_quantize_model(model)
    train_steps(model, torch.optim.SGD(model.parameters(), lr=0.01), batches(4))
    for fq in model.modules():
        if isinstance(fq, ActivationFakeQuantize):
            fq.observer_enabled = False
    path = export_onnx(model.eval(), torch.randn(1, 1, 8, 8), tmp_path / "qat.onnx", dynamo=False)
    result = quantize_qat_export(str(path), tmp_path / "int8.onnx")
    kinds = [n.op_type for n in result.model.graph.node]
    assert "QLinearConcat" in kinds and kinds.count("QLinearConv") == 3 and not result.float_nodes, kinds
    assert result.verification.max_steps <= 3


@pytest.mark.parametrize("dynamo", [False, True], ids=["torchscript", "dynamo"])
def test_silu_and_squeeze_excitation_run_on_the_integers(dynamo, tmp_path):
    """Each SiLU call site quantizes its sigmoid and its product, the gate's sigmoid and ``x * gate`` are quantized
    (an observer per call site; the shared ``act`` module gets one per call): the int8 model is QLinearSigmoid /
    QLinearMul throughout, nothing float but the returned probabilities' sigmoid, and matches the QAT export."""
    torch.manual_seed(0)
    model = SqueezeExcite()
    fake_quantize_model(model)
    result = _int8(model, tmp_path, dynamo)
    assert sorted(model.recal_sites) == [":mul:0", ":sigmoid:0", ":silu:0", "act:forward:0", "act:forward:1"]
    assert not model.act.inplace  # its sites recompute the call from the input
    kinds = [n.op_type for n in result.model.graph.node]
    assert kinds.count("QLinearSigmoid") == 4 and kinds.count("QLinearMul") == 4 and not result.float_nodes, kinds
    assert kinds.count("QLinearConv") == 5 and kinds.count("QLinearGlobalAveragePool") == 1, kinds
    assert kinds.count("Sigmoid") == 1  # the head's: its probabilities stay float
    v = result.verification
    assert v.local_steps <= 1 and v.max_abs_diff <= 1e-5, v
    x = torch.randn(16, 1, 8, 8)
    session = ort.InferenceSession(str(tmp_path / "int8.onnx"), providers=["CPUExecutionProvider"])
    got = session.run(None, {"input": x.numpy()})[0]
    with torch.no_grad():
        expected = model.eval()(x).numpy()
    # the PyTorch QAT model computes the same SiLUs (measured 3.7e-4: float rounding across a step)
    assert np.abs(got - expected).max() <= 2e-3


def test_a_librarys_own_silu_module_is_a_silu_site(tmp_path):
    """MobileViT, EfficientNet and others run SiLU through ``transformers.activations.SiLUActivation``: recognised
    by what it computes (F.silu exactly, no parameters), its call site quantizes the sigmoid too and the int8
    model runs QLinearSigmoid and QLinearMul where it sat (MobileViT-small went from 0.81x to 1.20x
    ``quantize_static`` on the VNNI/AMX Xeon); a parameterless module computing something else is not one."""
    from recal_torch.qat.patterns import is_silu_module

    torch.manual_seed(0)
    model = SqueezeExcite()
    model.act = LibrarySiLU()
    fake_quantize_model(model)
    result = _int8(model, tmp_path, False)
    assert "act:forward:0" in model.recal_sites and "act:forward:1" in model.recal_sites
    kinds = [n.op_type for n in result.model.graph.node]
    assert kinds.count("QLinearSigmoid") == 4 and kinds.count("QLinearMul") == 4 and not result.float_nodes, kinds
    assert not is_silu_module(nn.Hardswish()) and not is_silu_module(type("Gelu", (nn.Module,), {
        "forward": lambda self, x: torch.nn.functional.gelu(x)})())


def test_silu_sites_travel_in_checkpoints():
    torch.manual_seed(0)
    model = SqueezeExcite()
    fake_quantize_model(model)
    train_steps(model, torch.optim.SGD(model.parameters(), lr=0.01), batches(2))
    state = model.state_dict()
    assert "recal_sites.act:forward:0.sigmoid.scale" in state and "recal_sites.:silu:0.product.scale" in state
    torch.manual_seed(1)
    fresh = SqueezeExcite()
    fake_quantize_model(fresh)
    fresh.load_state_dict(state)
    fresh.eval(), model.eval()
    x = torch.randn(4, 1, 8, 8)
    torch.testing.assert_close(fresh(x), model(x))


@pytest.mark.parametrize("dynamo", [False, True], ids=["torchscript", "dynamo"])
def test_an_nn_sequential_root_keeps_running_with_call_site_observers(dynamo, tmp_path):
    """torchvision and timm build whole models as nn.Sequential. The call sites' observers are one more child of
    the root; the Sequential calls it last, and it passes its input through: training, export and conversion
    work as for any root, and the SiLU / squeeze-excitation sites inside run on the integers."""
    from recal_onnx import quantize_qat_export

    torch.manual_seed(0)
    model = nn.Sequential(SqueezeExcite(), nn.Unflatten(1, (10, 1)), nn.Flatten())
    fake_quantize_model(model)
    train_steps(model, torch.optim.SGD(model.parameters(), lr=0.01), batches(4))
    assert sorted(model.recal_sites) and len(model) == 4  # SqueezeExcite's sites, held by the root
    model.eval()
    x = torch.randn(3, 1, 8, 8)
    assert model(x).shape == (3, 10)
    path = export_onnx(model, x[:1], tmp_path / "qat.onnx", dynamo=dynamo)
    result = quantize_qat_export(str(path), tmp_path / "int8.onnx")
    kinds = [n.op_type for n in result.model.graph.node]
    assert "QLinearMul" in kinds and "QLinearSigmoid" in kinds and result.verification.max_steps <= 3


def test_modules_made_inside_forward_are_part_of_their_callers_plan(tmp_path, recwarn):
    from recal_onnx import quantize_qat_export

    torch.manual_seed(0)
    model = InlineModules()
    fake_quantize_model(model)
    train_steps(model, torch.optim.SGD(model.parameters(), lr=0.01), batches(4))
    # the add's only reader is the inline ReLU: its output holds the observer (the first ReLU folds into c1)
    assert sorted(model.recal_sites) == [":relu:1"] and model.c1.folded_bn is not None
    assert not [w for w in recwarn if "could not record" in str(w.message)]
    path = export_onnx(model.eval(), torch.randn(1, 1, 8, 8), tmp_path / "qat.onnx", dynamo=False)
    result = quantize_qat_export(str(path), tmp_path / "int8.onnx")
    kinds = [n.op_type for n in result.model.graph.node]
    assert "QLinearAdd" in kinds and kinds.count("QLinearConv") == 2 and not result.float_nodes, kinds


def test_a_forward_the_planner_cannot_record_is_a_warning_naming_the_layers():
    from recal_torch.qat import QATPlanWarning

    class Unrecordable(InlineModules):
        def forward(self, x):
            if torch.is_grad_enabled() is False and not getattr(self, "_seen", False):  # the planner's recording
                self._seen = True
                raise RuntimeError("a forward that fails while recorded")
            return super().forward(x)

    model = Unrecordable()
    fake_quantize_model(model)
    with pytest.warns(QATPlanWarning, match=r"could not record the first forward of Unrecordable \(RuntimeError: a "
                                            r"forward that fails while recorded\): residual adds.* stay float; "
                                            r"BatchNorm stays unfolded .* for c1, c2, fc"):
        model.train()(torch.randn(2, 1, 8, 8))


@pytest.mark.parametrize("dynamo", [False, True], ids=["torchscript", "dynamo"])
def test_stochastic_depth_before_a_residual_add_keeps_the_add_integer(dynamo, tmp_path):
    from recal_onnx import quantize_qat_export

    torch.manual_seed(0)
    model = MBConvLike()
    fake_quantize_model(model)
    train_steps(model, torch.optim.SGD(model.parameters(), lr=0.01), batches(4))
    assert sorted(model.recal_sites) == [":add:0"] or sorted(model.recal_sites) == [":iadd:0"], model.recal_sites
    path = export_onnx(model.eval(), torch.randn(1, 1, 8, 8), tmp_path / "qat.onnx", dynamo=dynamo)
    result = quantize_qat_export(str(path), tmp_path / "int8.onnx")
    kinds = [n.op_type for n in result.model.graph.node]
    assert "QLinearAdd" in kinds and not result.float_nodes, (kinds, result.float_nodes)


def test_the_float_warning_names_the_module_of_each_anonymous_dynamo_node(tmp_path):
    """The dynamo exporter names nodes ``node_gelu``; the warning adds the module that ran each (its namespace
    metadata), one node per line."""
    from recal_onnx import UnconvertedOpsWarning, quantize_qat_export

    class Gelu(nn.Module):
        def __init__(self):
            super().__init__()
            self.c1, self.act, self.c2 = nn.Conv2d(1, 4, 3, padding=1), nn.GELU(), nn.Conv2d(4, 4, 3, padding=1)
            self.fc = nn.Linear(4 * 8 * 8, 10)

        def forward(self, x):
            return self.fc(torch.flatten(self.c2(self.act(self.c1(x))), 1))

    torch.manual_seed(0)
    model = Gelu()
    fake_quantize_model(model)
    train_steps(model, torch.optim.SGD(model.parameters(), lr=0.01), batches(2))
    path = export_onnx(model.eval(), torch.randn(1, 1, 8, 8), tmp_path / "qat.onnx")
    with pytest.warns(UnconvertedOpsWarning) as caught:
        quantize_qat_export(str(path), tmp_path / "int8.onnx")
    head, *lines = str(caught[0].message).splitlines()
    assert head.startswith("left in float") and "Erf x1" in head and len(lines) >= 2  # GELU, written out by dynamo
    # each with its reason after the module
    assert all(line.startswith("  ") and "' in module act (" in line and line.endswith(")") for line in lines), lines


def test_a_layer_called_twice_is_left_float_with_a_warning_naming_it():
    from recal_torch.qat import QATPlanWarning

    model = SharedConv()
    with pytest.warns(QATPlanWarning, match=r"'c2' \(2 calls\) called more than once in SharedConv's forward: left "
                                            r"float"):
        created = fake_quantize_model(model)
    assert type(model.c2) is nn.Conv2d and len(created) == 2  # c1 and fc

    model = SharedConv()
    manager = ScheduledModifierManager.from_yaml("- !QuantizationModifier {start_epoch: 0}\n")
    with pytest.warns(QATPlanWarning):
        manager.modify(model, torch.optim.SGD(model.parameters(), lr=0.01), steps_per_epoch=2)
    assert manager.quantized_layers["c2"] == "float: called 2 times in one forward", manager.quantized_layers


@pytest.mark.slow
def test_a_torch_compiled_submodule_is_planned_and_runs_on_the_integers(tmp_path, recwarn):
    """The planner records the first forward with torch.compile's stance forced to eager: the compiled block's
    conv is planned, the add around it gets its observer, and the int8 model is integer throughout."""
    from recal_onnx import quantize_qat_export

    torch.manual_seed(0)
    model = CompiledBlock()
    fake_quantize_model(model)
    train_steps(model, torch.optim.SGD(model.parameters(), lr=0.01), batches(2))
    assert not [w for w in recwarn if "could not record" in str(w.message)]
    assert sorted(model.recal_sites) == [":add:0"]
    path = export_onnx(model.eval(), torch.randn(1, 1, 8, 8), tmp_path / "qat.onnx", dynamo=False)
    result = quantize_qat_export(str(path), tmp_path / "int8.onnx")
    kinds = [n.op_type for n in result.model.graph.node]
    assert "QLinearAdd" in kinds and not result.float_nodes, (kinds, result.float_nodes)


def test_the_users_forward_hooks_follow_their_layer_into_qat():
    """A feature-extraction hook on a conv keeps firing on its QAT module; a hook on a BatchNorm that folds away is
    named in a warning."""
    from recal_torch.qat import QATPlanWarning

    seen = []
    model = SmallCNN()
    model.conv3.register_forward_hook(lambda module, args, out: seen.append((type(module).__name__, out.shape)))
    fake_quantize_model(model)
    model(torch.randn(2, 1, 8, 8))
    assert seen and seen[-1][0].startswith("QATConv")

    class ConvBN(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv, self.bn = nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4)

        def forward(self, x):
            return self.bn(self.conv(x))

    model = ConvBN()
    model.bn.register_forward_hook(lambda *args: None)
    with pytest.warns(QATPlanWarning, match=r"'bn' \(BatchNorm2d\) has forward hooks, and QAT folds it"):
        fake_quantize_model(model)


def test_a_branch_the_first_forward_did_not_take_is_named():
    from recal_torch.qat import QATPlanWarning

    class Branchy(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Conv2d(1, 4, 3, padding=1), nn.Conv2d(1, 4, 3, padding=1)
            self.fc = nn.Linear(4 * 8 * 8, 10)

        def forward(self, x):
            y = self.a(x) if float(x.mean()) < 1e9 else self.b(x)  # data-dependent: fx cannot trace it
            return self.fc(torch.flatten(y, 1))

    model = Branchy()
    fake_quantize_model(model)
    with pytest.warns(QATPlanWarning, match=r"first forward of Branchy did not reach b \(a branch not taken\?\)"):
        model(torch.randn(2, 1, 8, 8))
