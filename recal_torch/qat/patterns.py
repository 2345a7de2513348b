"""What the QAT planner recognises in a forward: ops that keep a tensor's quantization (data movement, max-pool,
ReLU, zero padding), modules that are identity at inference (dropout, stochastic depth), BatchNorms that apply
their own activation (timm's BatchNormAct2d), the clamps that fold into a layer's range (ReLU, ReLU6), and the
concatenations and average pools that get call sites."""

from __future__ import annotations

import operator

import torch
import torch.nn.functional as F
from torch import nn

from .layers import NORMS, FoldedBatchNorm, QuantizedReLU
from .trace import RELUS


_PRESERVING_MODULES = (nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d, nn.ReLU, nn.ReLU6, nn.Flatten, nn.Unflatten,
                       nn.Dropout, nn.Identity, FoldedBatchNorm, QuantizedReLU)
_CONSTANT_PADS = (nn.ConstantPad1d, nn.ConstantPad2d, nn.ConstantPad3d)  # nn.ZeroPad2d is one
_DROPOUTS = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.FeatureAlphaDropout)
IDENTITY_AT_EVAL = {"StochasticDepth", "DropPath", "DropBlock2d"}  # torchvision's and timm's, by class name


def identity_at_eval(module: nn.Module | None) -> bool:
    """A module that returns its input unchanged at inference (dropout, stochastic depth): the int8 model has
    no op there, so what it passes on keeps its quantization; fx keeps it as one node rather than trace its
    training branch (random masks) into the graph."""
    return isinstance(module, (*_DROPOUTS, nn.Identity)) or type(module).__name__ in IDENTITY_AT_EVAL
def norm_activation(module: nn.Module | None) -> str | None:
    """For a BatchNorm that applies its own activation, as timm's ``BatchNormAct2d`` does (a BatchNorm subclass
    with an ``act`` child, and a ``drop`` one that is identity at eval): ``"relu"``, ``"relu6"`` or ``"none"`` (an
    ``nn.Identity`` act), the activation folded with it into the conv before it; None for any other module, or
    an activation that cannot be folded (it stays, and the BatchNorm with it)."""
    if not isinstance(module, nn.modules.batchnorm._BatchNorm) or type(module) in NORMS.values():
        return None
    act, drop = getattr(module, "act", None), getattr(module, "drop", None)
    if not isinstance(act, nn.Module) or (drop is not None and not identity_at_eval(drop)):
        return None
    return "none" if isinstance(act, nn.Identity) else "relu6" if isinstance(act, nn.ReLU6) else \
        "relu" if isinstance(act, nn.ReLU) else None


# data movement and selection: every value out is one of the values in, on the same grid (a channel split or
# shuffle, a slice); operator.getitem picks a chunk's part, or slices a tensor
_PRESERVING_FUNCTIONS = {torch.flatten, torch.reshape, torch.relu, F.relu, F.relu6, F.max_pool1d, F.max_pool2d,
                         F.max_pool3d, torch.squeeze, torch.unsqueeze, F.dropout, torch.chunk, torch.split,
                         torch.transpose, torch.permute, torch.narrow, operator.getitem}
_PRESERVING_METHODS = {"view", "reshape", "flatten", "relu", "contiguous", "squeeze", "unsqueeze", "relu_", "chunk",
                       "split", "transpose", "permute", "narrow"}
CATS = {torch.cat, torch.concat, torch.concatenate}
AVG_POOLS = (nn.AvgPool1d, nn.AvgPool2d, nn.AvgPool3d, nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d, nn.AdaptiveAvgPool3d)
AVG_POOL_FUNCTIONS = {F.avg_pool1d, F.avg_pool2d, F.avg_pool3d, F.adaptive_avg_pool1d, F.adaptive_avg_pool2d,
                      F.adaptive_avg_pool3d}


def preserves_quantization(node: torch.fx.Node, module: nn.Module | None) -> bool:
    if node.op == "call_module":
        return isinstance(module, _PRESERVING_MODULES) or identity_at_eval(module) or (
            isinstance(module, _CONSTANT_PADS) and module.value == 0)
    if node.op == "call_function":
        if node.target is F.pad:  # zero padding: the runtime pads the integers with the zero point
            mode = node.kwargs.get("mode", node.args[2] if len(node.args) > 2 else "constant")
            value = node.kwargs.get("value", node.args[3] if len(node.args) > 3 else None)
            return mode == "constant" and not value
        return node.target in _PRESERVING_FUNCTIONS
    if node.op == "call_method":
        return node.target in _PRESERVING_METHODS
    return False


def clamping_activation(node: torch.fx.Node, module: nn.Module | None) -> str | None:
    """``"relu"`` / ``"relu6"`` when ``node`` is a ReLU or ReLU6 (a module, a function or a method), else None:
    a clamp that folds into the range of the quantized output before it."""
    if node.op == "call_module":
        if type(module) is nn.ReLU:
            return "relu"
        if type(module) is nn.ReLU6 or (type(module) is nn.Hardtanh and (module.min_val, module.max_val) == (0, 6)):
            return "relu6"
    elif node.op == "call_function":
        if node.target in RELUS:
            return "relu"
        if node.target is F.relu6:
            return "relu6"
        if node.target is F.hardtanh:
            bounds = list(node.args[1:3]) + [None, None]
            low = node.kwargs.get("min_val", bounds[0] if bounds[0] is not None else -1.0)
            high = node.kwargs.get("max_val", bounds[1] if bounds[1] is not None else 1.0)
            return "relu6" if (low, high) == (0, 6) else None
    elif node.op == "call_method" and node.target in ("relu", "relu_"):
        return "relu"
    return None


_PROBE = torch.linspace(-8.0, 8.0, 129)


def is_silu_module(module: nn.Module | None) -> bool:
    """``nn.SiLU``, or a library's own SiLU module (Hugging Face's ``SiLUActivation``, timm's ``Swish``): a module
    with no parameters, buffers or children, from outside torch, that computes exactly ``F.silu`` on a probe. Its
    call site then quantizes the sigmoid too (``SiLUFakeQuantize``), as for ``nn.SiLU``."""
    if isinstance(module, nn.SiLU):
        return True
    if module is None or type(module).__module__.startswith("torch.") or any(True for _ in module.children()) \
            or any(True for _ in module.parameters()) or any(True for _ in module.buffers()):
        return False
    known = module.__dict__.get("_recal_is_silu")
    if known is None:
        try:
            with torch.no_grad():
                out = module(_PROBE.clone())
            known = isinstance(out, torch.Tensor) and out.shape == _PROBE.shape and torch.equal(out, F.silu(_PROBE))
        except Exception:  # noqa: BLE001 - a module that cannot take the probe is not a SiLU
            known = False
        module.__dict__["_recal_is_silu"] = known
    return known
