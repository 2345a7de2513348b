"""Each exported conv / linear bias put on the int32 grid that its int8 layer holds it on.

An int8 runtime adds the bias to the integer accumulator, as ``round(bias / (s_x * s_w))`` in steps of the input
scale times the weight scale. A float bias off that grid moves the layer's output by up to half a step of
``s_x * s_w``: a tiny shift, but it moves every value that sat near a rounding boundary of the output, and on a
deep net those one-step flips travel (measured on Hugging Face's MobileNetV2 at 32x32: argmax agreement between
the QAT export and its int8 model 0.91 with float biases, 1.00 with biases on the grid, 256 inputs). So the export
writes the bias the int8 model will hold; the change is at most half a step of ``s_x * s_w`` per channel.

``s_x`` is read off one forward of the export model on the sample input: every quantize-dequantize tags its
output with its scale, and ops that keep values on their input's grid (zero padding, ReLU, max pooling,
reshapes, slices, concatenation of one grid) pass the tag on. A layer whose input carries no tag (its input is
float), or two different ones (called at several sites), keeps its float bias.
"""

from __future__ import annotations

import logging
import weakref

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from .modules import QuantizedExportModule

log = logging.getLogger(__name__)

INT32_MAX = 2 ** 31 - 1

_SAME_GRID = {F.relu, torch.relu, torch.relu_, F.max_pool1d, F.max_pool2d, F.max_pool3d, F.adaptive_max_pool1d,
              F.adaptive_max_pool2d, F.adaptive_max_pool3d, torch.flatten, torch.reshape, torch.squeeze,
              torch.unsqueeze, torch.permute, torch.transpose, torch.narrow, F.dropout, F.dropout1d, F.dropout2d,
              F.dropout3d, torch.clone}
_SAME_GRID_METHODS = {"relu", "relu_", "view", "reshape", "flatten", "permute", "transpose", "contiguous", "squeeze",
                      "unsqueeze", "__getitem__", "narrow", "clone", "expand", "repeat"}
_CONCATS = {torch.cat, torch.concat, torch.concatenate}


def _dequantize_per_tensor():
    """The op the dynamo export path dequantizes with (registered by :mod:`recal_torch.export`), or None."""
    ops = getattr(torch.ops, "quantized_decomposed", None)
    return getattr(ops, "dequantize_per_tensor", None) if ops is not None else None


class _GridTags(TorchFunctionMode):
    """Tags each tensor that holds ``s * integer`` values with ``s``, while a forward runs under it."""

    def __init__(self):
        super().__init__()
        self.tags: dict[int, tuple[weakref.ref, float]] = {}

    def scale_of(self, x: object) -> float | None:
        entry = self.tags.get(id(x)) if isinstance(x, torch.Tensor) else None
        return entry[1] if entry is not None and entry[0]() is x else None

    def _tag(self, out: object, scale: float | None) -> None:
        if scale is not None and isinstance(out, torch.Tensor):
            self.tags[id(out)] = (weakref.ref(out), scale)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func is torch.fake_quantize_per_tensor_affine or func is _dequantize_per_tensor():
            scale = args[1] if len(args) > 1 else kwargs["scale"]
            self._tag(out, float(scale))
        elif func is F.pad:
            mode = kwargs.get("mode", args[2] if len(args) > 2 else "constant")
            value = kwargs.get("value", args[3] if len(args) > 3 else None)
            if mode == "constant" and not value:
                self._tag(out, self.scale_of(args[0]))
        elif func in _SAME_GRID or getattr(func, "__name__", None) in _SAME_GRID_METHODS:
            self._tag(out, self.scale_of(args[0]) if args else None)
        elif func in _CONCATS and args:
            scales = {self.scale_of(t) for t in args[0]}
            self._tag(out, scales.pop() if len(scales) == 1 else None)
        elif isinstance(out, torch.Tensor):
            self.tags.pop(id(out), None)  # an in-place op (``out += identity``) returns its input, changed
        return out


def round_biases(export_model: nn.Module, inputs: tuple) -> int:
    """Put the bias of each of ``export_model``'s int8 conv / linear layers on its int32 grid (see the module);
    return how many were."""
    layers = {m: set() for m in export_model.modules()
              if isinstance(m, QuantizedExportModule) and not m.is_table and m.bias is not None}
    if not layers:
        return 0
    tags = _GridTags()

    def seen(module, args):
        x = args[0] if args else None
        layers[module].add(module.input_qparams[0] if module.input_qparams is not None else tags.scale_of(x))

    hooks = [m.register_forward_pre_hook(seen) for m in layers]
    try:
        with torch.no_grad(), tags:
            export_model(*inputs)
    finally:
        for hook in hooks:
            hook.remove()
    rounded, left = 0, []
    for layer, scales in layers.items():
        if len(scales) != 1 or None in scales:
            left.append(layer)
            continue
        step = scales.pop() * layer.weight_scale.double()
        steps = torch.round(layer.bias.double() / step)
        if steps.abs().max() > INT32_MAX:
            left.append(layer)  # the converter leaves this layer float and says why
            continue
        layer.bias.copy_((steps * step).to(layer.bias.dtype))
        rounded += 1
    log.info("QAT export: %d conv/linear biases on the int32 grid of their int8 layers (input scale x weight "
             "scale)%s", rounded, f"; {len(left)} kept float (input not quantized, several input scales, "
                                  "or beyond int32)" if left else "")
    return rounded
