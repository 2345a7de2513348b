"""The export forms of QAT modules: constant quantization parameters, BatchNorm folded, int8 weights.

Each QAT module of a model is swapped, in the copy :func:`recal_torch.export.to_export_model` makes, for one of
these. Under the default (dynamo) exporter the quantize/dequantize steps are written with
``torch.ops.quantized_decomposed`` (``torch.fake_quantize_*`` does not export there); under ``dynamo=False`` with
``torch.fake_quantize_*``, which that exporter turns into QDQ.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..qat import (ACT_QMAX, ACT_QMIN, SLOTS, W_QMAX, W_QMIN, ActivationFakeQuantize, AttentionFakeQuantize, QATConv,
                   QATEmbedding, QATModule, QuantizedReLU, WeightOnlyEmbedding, WeightOnlyLinear, clamp)


def decomposed_ops():
    # Registers torch.ops.quantized_decomposed (used only to express QDQ for the dynamo exporter).
    import torch.ao.quantization.fx._decomposed

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
            levels = qat.weight_fake_quant.levels
            q = torch.clamp(torch.round(weight / scale.reshape(shape)), -levels, levels)
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
            return decomposed_ops().dequantize_per_channel(
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


class WeightOnlyExport(nn.Module):
    """A :class:`WeightOnlyLinear` frozen for export: float input, its weight dequantized from integers.

    The integers are written as ``[out * groups, group_size]`` rows, each row one group with its own scale (a
    per-channel DequantizeLinear on axis 0, which both exporters and every opset >= 13 write), reshaped to
    ``[out, in]``: the form :mod:`recal_onnx.passes.matmul_to_nbits` turns into ``MatMulNBits``. Under TorchScript the
    rows are the dequantized values behind ``fake_quantize`` on the int8 range (values on the int4 grid are
    unchanged by it), which that exporter writes as QuantizeLinear / DequantizeLinear.
    """

    def __init__(self, layer: WeightOnlyLinear, dynamo: bool):
        super().__init__()
        self.dynamo = dynamo
        self.in_features, self.out_features = layer.in_features, layer.out_features
        self.padding_idx = getattr(layer, "padding_idx", None)
        self.is_table = isinstance(layer, WeightOnlyEmbedding)
        fq = layer.weight_fake_quant
        q = fq.integers(layer.oriented_weight()).reshape(-1, fq.group_size)
        scale = fq.scale.detach().reshape(-1).clone()  # what integers() quantized with
        if dynamo:
            self.register_buffer("weight_int", q)
        else:
            self.register_buffer("weight_dequantized", (q.float() * scale.reshape(-1, 1)).detach().clone())
        self.register_buffer("weight_scale", scale)
        self.register_buffer("weight_zero_point", torch.zeros_like(scale, dtype=torch.int32))
        self.register_buffer("bias", None if layer.bias is None else layer.bias.detach().clone())

    @property
    def weight(self) -> torch.Tensor:
        """The dequantized ``[out, in]`` weight, for model code that reads ``layer.weight``."""
        if self.dynamo:
            rows = decomposed_ops().dequantize_per_channel(
                self.weight_int, self.weight_scale, self.weight_zero_point, 0, W_QMIN, W_QMAX, torch.int8)
        else:
            rows = torch.fake_quantize_per_channel_affine(
                self.weight_dequantized, self.weight_scale, self.weight_zero_point, 0, W_QMIN, W_QMAX)
        return rows.reshape(self.out_features, self.in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.is_table:
            return F.embedding(x, self.weight, self.padding_idx)
        return F.linear(x, self.weight, self.bias)


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
        ops = decomposed_ops()
        q = ops.quantize_per_tensor(x, scale, zero_point, ACT_QMIN, ACT_QMAX, torch.uint8)
        return ops.dequantize_per_tensor(q, scale, zero_point, ACT_QMIN, ACT_QMAX, torch.uint8)
    return torch.fake_quantize_per_tensor_affine(x, scale, zero_point, ACT_QMIN, ACT_QMAX)


def _qparams(fq) -> tuple[float, int] | None:
    if fq is None or not fq.active:
        return None
    if not fq.has_observed:
        raise ValueError("a QAT activation quantizer has not observed any data yet (its range is unknown): "
                         "train at least one step with quantization on before exporting")
    return float(fq.scale.detach()), int(fq.zero_point)
