"""ONNX export: a float model as is (its pruned zeros intact), a QAT model as QuantizeLinear/DequantizeLinear.

QAT modules are replaced, in a copy of the model, by export modules whose quantization
parameters are constants and whose BatchNorm is already folded into the conv weight and
bias, so runtimes see ``DQ(x), DQ(w_int8) -> Conv -> (Relu) -> Q`` and fuse it. Each bias is
written on the int32 grid the int8 layer holds it on (:mod:`recal_torch.bias_grid`).

Under the default (dynamo) exporter the quantize/dequantize steps are written with
``torch.ops.quantized_decomposed`` (``torch.fake_quantize_*`` does not export there);
under ``dynamo=False`` with ``torch.fake_quantize_*``, which that exporter turns into QDQ.
"""

from __future__ import annotations

import copy
import logging
import os
import warnings
from pathlib import Path
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from recal_core.atomic import atomic_folder

from .bias_grid import round_biases
from .model_params import unwrap
from .qat import (ACT_QMAX, ACT_QMIN, W_LEVELS, W_QMAX, W_QMIN, ActivationFakeQuantize, QATConv, QATEmbedding,
                  QATModule, QuantizedReLU, clamp, plan_pending, qat_modules)
from .qat_sites import CONTAINER
from .qat_attention import SLOTS, AttentionFakeQuantize

log = logging.getLogger(__name__)

MIN_DYNAMO_OPSET = 18  # the lowest opset torch's dynamo exporter implements (converting down fails for QDQ)
DEFAULT_TORCHSCRIPT_OPSET = 17
EXTERNAL_DATA_BYTES = 1_800_000_000


def _parameter_bytes(model: nn.Module) -> int:
    tensors = list(model.parameters()) + list(model.buffers())
    return sum(t.numel() * t.element_size() for t in tensors)


def _decomposed_ops():
    # Registers torch.ops.quantized_decomposed (used only to express QDQ for the dynamo exporter).
    import torch.ao.quantization.fx._decomposed  # noqa: F401

    return torch.ops.quantized_decomposed


class QuantizedExportModule(nn.Module):
    """A QAT conv/linear frozen for export: constant qparams, folded int8 weight, float bias."""

    def __init__(self, qat: QATModule, dynamo: bool):
        super().__init__()
        self.dynamo = dynamo
        self.is_conv = isinstance(qat, QATConv)
        self.is_table = isinstance(qat, QATEmbedding)
        if self.is_table:
            self.padding_idx = qat.padding_idx
        if self.is_conv:
            self.stride, self.padding, self.dilation, self.groups, self.dims = (
                qat.stride, qat.padding, qat.dilation, qat.groups, qat.dims)
        self.relu, self.relu6 = qat.relu, qat.relu6
        for name in ("kernel_size", "in_channels", "out_channels", "padding_mode", "in_features", "out_features"):
            if hasattr(qat, name):  # what model code reads off the layer it calls
                setattr(self, name, getattr(qat, name))
        with torch.no_grad():
            weight, bias = qat.folded_weight_and_bias()
            scale, _ = qat.weight_fake_quant.qparams(weight)
            shape = (-1,) + (1,) * (weight.dim() - 1)
            q = torch.clamp(torch.round(weight / scale.reshape(shape)), -W_LEVELS, W_LEVELS)
        # each exporter reads the weight its own way: int8 behind a dequantize op, or the dequantized
        # floats behind fake_quantize (which the TorchScript exporter turns into Q/DQ)
        if dynamo:
            self.register_buffer("weight_int8", q.to(torch.int8))
        else:
            self.register_buffer("weight_dequantized", (q * scale.reshape(shape)).detach().clone())
        self.register_buffer("weight_scale", scale.detach().clone())
        self.register_buffer("weight_zero_point", torch.zeros_like(scale, dtype=torch.int32))
        self.register_buffer("bias", None if bias is None else bias.detach().clone())
        self.input_qparams = _qparams(qat.input_fake_quant)
        self.output_qparams = _qparams(qat.activation_post_process)

    def _qdq(self, x: torch.Tensor, qparams: tuple[float, int]) -> torch.Tensor:
        return _qdq(x, qparams, self.dynamo)

    def _weight(self) -> torch.Tensor:
        if self.dynamo:
            return _decomposed_ops().dequantize_per_channel(
                self.weight_int8, self.weight_scale, self.weight_zero_point, 0, W_QMIN, W_QMAX, torch.int8)
        return torch.fake_quantize_per_channel_affine(
            self.weight_dequantized, self.weight_scale, self.weight_zero_point, 0, W_QMIN, W_QMAX)

    @property
    def weight(self) -> torch.Tensor:
        """The dequantized weight, for model code that reads ``layer.weight`` (its dtype, its shape)."""
        return self._weight()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.input_qparams is not None:
            x = self._qdq(x, self.input_qparams)
        weight = self._weight()
        if self.is_table:
            return F.embedding(x, weight, self.padding_idx)
        if self.is_conv:
            conv = (F.conv1d, F.conv2d, F.conv3d)[self.dims - 1]
            y = conv(x, weight, self.bias, self.stride, self.padding, self.dilation, self.groups)
        else:
            y = F.linear(x, weight, self.bias)
        y = clamp(y, self.relu, self.relu6)
        return y if self.output_qparams is None else self._qdq(y, self.output_qparams)


class ActivationQDQ(nn.Module):
    """An :class:`ActivationFakeQuantize` frozen for export (a call site's): QDQ with constant parameters."""

    def __init__(self, module: ActivationFakeQuantize, dynamo: bool):
        super().__init__()
        self.dynamo = dynamo
        self.qparams = _qparams(module)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.qparams is None else _qdq(x, self.qparams, self.dynamo)


class QuantizedReLUExport(ActivationQDQ):
    """A :class:`QuantizedReLU` frozen for export: ReLU, then QDQ with constant parameters."""

    def __init__(self, module: QuantizedReLU, dynamo: bool):
        super().__init__(module.activation_post_process, dynamo)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(F.relu(x))


class AttentionQDQ(nn.Module):
    """An :class:`AttentionFakeQuantize` frozen for export: each matmul operand through QDQ, constant parameters."""

    def __init__(self, module: AttentionFakeQuantize, dynamo: bool):
        super().__init__()
        self.dynamo = dynamo
        self.qparams = {slot: _qparams(getattr(module, slot)) for slot in SLOTS}

    def quantize(self, slot: str, x: torch.Tensor) -> torch.Tensor:
        qparams = self.qparams[slot]
        return x if qparams is None else _qdq(x, qparams, self.dynamo)


def _qdq(x: torch.Tensor, qparams: tuple[float, int], dynamo: bool) -> torch.Tensor:
    """uint8 quantize-dequantize, written as the ops each exporter turns into QuantizeLinear/DequantizeLinear."""
    scale, zero_point = qparams
    if dynamo:
        ops = _decomposed_ops()
        q = ops.quantize_per_tensor(x, scale, zero_point, ACT_QMIN, ACT_QMAX, torch.uint8)
        return ops.dequantize_per_tensor(q, scale, zero_point, ACT_QMIN, ACT_QMAX, torch.uint8)
    return torch.fake_quantize_per_tensor_affine(x, scale, zero_point, ACT_QMIN, ACT_QMAX)


def _qparams(fq) -> tuple[float, int] | None:
    if fq is None or not fq.active:
        return None
    if not fq.has_observed:
        raise ValueError("a QAT activation quantizer has not observed any data yet (its range is unknown): "
                         "train at least one step with quantization on before exporting")
    return float(fq.scale), int(fq.zero_point)


def to_export_model(model: nn.Module, dynamo: bool = True, sample_input: Sequence[torch.Tensor] | None = None
                    ) -> nn.Module:
    """An eval-mode copy of ``model`` whose QAT modules are export modules (the model is not changed).

    With ``sample_input`` (a tuple of the model's inputs), each conv / linear bias is put on the int32 grid its
    int8 layer holds it on (:mod:`recal_torch.bias_grid`), as :func:`export_onnx` does."""
    model = unwrap(model)
    exported = copy.deepcopy(model)
    exported.eval()
    for name, module in list(exported.named_modules()):
        if isinstance(module, ActivationFakeQuantize) and CONTAINER in name.split("."):
            # a call site's observer, or one of a SiLU site's two (SiLUFakeQuantize keeps its own forward)
            parent_name, _, child = name.rpartition(".")
            setattr(exported.get_submodule(parent_name), child, ActivationQDQ(module, dynamo))
        elif isinstance(module, (QATModule, QuantizedReLU, AttentionFakeQuantize)):
            parent_name, _, child = name.rpartition(".")
            parent = exported.get_submodule(parent_name) if parent_name else exported
            replacement = (QuantizedExportModule(module, dynamo) if isinstance(module, QATModule)
                           else AttentionQDQ(module, dynamo) if isinstance(module, AttentionFakeQuantize)
                           else QuantizedReLUExport(module, dynamo))
            setattr(parent, child, replacement)
    if sample_input is not None:
        round_biases(exported, tuple(sample_input))
    return exported


def export_onnx(model: nn.Module, sample_input: torch.Tensor | Sequence[torch.Tensor], path: str | os.PathLike,
                opset: int | None = None, *, dynamo: bool = True, input_names: Sequence[str] = ("input",),
                output_names: Sequence[str] = ("output",), dynamic_batch: bool = True) -> Path:
    """Export ``model`` to ONNX at ``path`` (atomically); QAT models become QDQ models.

    ``opset`` defaults to 18 under ``dynamo=True`` (torch's default exporter, which implements
    opset 18 and later: an older one is an error, not a silent upgrade) and to 17 under
    ``dynamo=False`` (13 or later for per-channel weights).

    >>> import torch, tempfile, os
    >>> m = torch.nn.Sequential(torch.nn.Linear(4, 2))
    >>> p = export_onnx(m, torch.randn(1, 4), os.path.join(tempfile.mkdtemp(), "m.onnx"), dynamo=False)
    >>> p.suffix
    '.onnx'
    """
    if isinstance(model, QATModule):
        raise TypeError("export the model that contains the QAT module, not the module itself")
    if opset is None:
        opset = MIN_DYNAMO_OPSET if dynamo else DEFAULT_TORCHSCRIPT_OPSET
    if dynamo and opset < MIN_DYNAMO_OPSET:
        raise ValueError(f"torch's default (dynamo) exporter writes opset {MIN_DYNAMO_OPSET} or later, not {opset}; "
                         f"pass opset>={MIN_DYNAMO_OPSET}, or dynamo=False for opset {opset}")
    inputs = tuple(sample_input) if isinstance(sample_input, (list, tuple)) else (sample_input,)
    if dynamo:
        _decomposed_ops()  # before export: the exporter's registry maps these ops only if they exist
    plan_pending(unwrap(model), inputs)  # a QAT plan still waiting for the first forward is made on the sample
    export_model = to_export_model(model, dynamo, inputs)
    kwargs: dict = {"opset_version": opset, "input_names": list(input_names), "output_names": list(output_names)}
    if dynamo:
        kwargs["verbose"] = False
        if dynamic_batch:
            kwargs["dynamic_shapes"] = tuple({0: torch.export.Dim.DYNAMIC} for _ in inputs)
        # One file unless the weights need ONNX external data (protobuf's 2 GB limit).
        kwargs["external_data"] = _parameter_bytes(export_model) > EXTERNAL_DATA_BYTES
    elif dynamic_batch:
        kwargs["dynamic_axes"] = {name: {0: "batch"} for name in [*input_names, *output_names]}
    target = Path(path)
    with atomic_folder(target.parent) as folder, warnings.catch_warnings():
        # torch's exporters warn about their own internals (opset conversion, TorchScript deprecation).
        warnings.filterwarnings("ignore", module=r"torch\..*")
        warnings.filterwarnings("ignore", category=DeprecationWarning)
        with torch.no_grad():
            torch.onnx.export(export_model, inputs, str(folder / target.name), dynamo=dynamo, **kwargs)
    log.info("exported %s model to %s", "QAT" if qat_modules(model) else "float", path)
    return Path(path)
