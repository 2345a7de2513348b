"""A PyTorch model as the core's channel-coupling ops (:mod:`recal_core.channel_coupling`), from a
``torch.fx`` trace: which layers share channels, for filter/channel pruning and :func:`recal_torch.thin`."""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from recal_core.channel_coupling import ModelGraph, Op, Space, channel_spaces

from .export_graph import example_inputs_of, exported_graph
from ..qat import CONVS, ActivationFakeQuantize, FoldedBatchNorm, QATConv, QATLinear, QATModule, QuantizedReLU
from ..sharding import forward_to_trace, is_sharded_module, unsharded_class

_ZERO_PRESERVING_MODULES = (nn.ReLU, nn.ReLU6, nn.Hardtanh, nn.LeakyReLU, nn.SiLU, nn.GELU, nn.Tanh, nn.Hardswish,
                            nn.Dropout, nn.Identity, nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d, nn.AvgPool1d,
                            nn.AvgPool2d, nn.AvgPool3d, nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d,
                            nn.AdaptiveAvgPool3d, nn.AdaptiveMaxPool2d, QuantizedReLU,
                            ActivationFakeQuantize)
_ZERO_PRESERVING_FUNCTIONS = {F.relu, torch.relu, F.relu6, F.hardtanh, F.silu, F.gelu, torch.tanh, F.hardswish,
                              F.dropout, F.max_pool2d, F.avg_pool2d, F.adaptive_avg_pool2d, F.leaky_relu}
_ZERO_PRESERVING_METHODS = {"relu", "relu_", "contiguous"}
_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)


def _is_depthwise(m: nn.Module) -> bool:
    return isinstance(m, (*CONVS, QATConv)) and m.groups > 1 and m.groups == m.weight.shape[0] \
        and m.weight.shape[1] == 1


class _Tracer(torch.fx.Tracer):
    """recal's QAT modules are leaves, as torch's own layers are. A module FSDP2 sharded (``fully_shard`` makes
    its class a subclass ``FSDP<Layer>`` with hooks that gather the weights) is traced as the layer it was: a torch
    layer is a leaf, anything else is entered through its own ``forward``, without the hooks."""

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        sharded_layer = is_sharded_module(m) and unsharded_class(m).__module__.startswith("torch.nn") \
            and not isinstance(m, nn.Sequential)
        return isinstance(m, (QATModule, QuantizedReLU, FoldedBatchNorm, ActivationFakeQuantize)) \
            or super().is_leaf_module(m, qualname) or sharded_layer

    def call_module(self, m: nn.Module, forward, args, kwargs):
        if not self.is_leaf_module(m, self.path_of_module(m)):
            forward = forward_to_trace(m, forward)  # the layer's forward, not FSDP's gathering hooks around it
        return super().call_module(m, forward, args, kwargs)


def model_ops(model: nn.Module) -> list[Op]:
    """``model``'s ops for the coupling rules (``torch.fx`` must trace it; the error says why if not)."""
    graph = _Tracer().trace(model)
    modules = dict(model.named_modules())
    ops = []
    for node in graph.nodes:
        tensors = tuple(a.name for a in node.all_input_nodes)
        if node.op == "placeholder":
            ops.append(Op(node.name, "input", (), node.name))
        elif node.op == "output":
            ops.append(Op("the model's output", "output", tensors))
        elif node.op == "get_attr":
            ops.append(Op(node.target, "other", (), node.name))
        elif node.op == "call_module":
            ops.append(_module_op(node.target, modules[node.target], tensors, node.name))
        elif node.op == "call_function" and node.target in (operator.add, torch.add) and len(tensors) == 2 \
                and not node.kwargs:
            ops.append(Op(node.name, "add", tensors, node.name))
        elif (node.op == "call_function" and node.target in _ZERO_PRESERVING_FUNCTIONS) or \
                (node.op == "call_method" and node.target in _ZERO_PRESERVING_METHODS):
            ops.append(Op(node.name, "same", tensors[:1], node.name) if len(tensors) == 1
                       else Op(node.name, "other", tensors, node.name))
        elif _is_flatten(node):
            ops.append(Op(node.name, "flatten", tensors, node.name))
        elif _is_global_mean(node):
            ops.append(Op(node.name, "same", tensors, node.name))
        else:
            ops.append(Op(str(node.target if node.op != "call_function" else node.target.__name__), "other",
                          tensors, node.name))
    return ops


def _module_op(name: str, m: nn.Module, tensors: tuple[str, ...], out: str) -> Op:
    if _is_depthwise(m):
        return Op(name, "depthwise", tensors, out, f"{name}.weight", _param(m, name, "bias"))
    layer = unsharded_class(m)
    if (isinstance(m, CONVS) and m.groups == 1) or layer is nn.Linear or \
            (isinstance(m, (QATConv, QATLinear)) and getattr(m, "groups", 1) == 1):
        return Op(name, "layer", tensors, out, f"{name}.weight", _param(m, name, "bias"))
    if isinstance(m, (*_NORMS, FoldedBatchNorm)):  # BN(0) = 0 once its shift and running mean are 0
        return Op(name, "norm", tensors, out, _param(m, name, "weight"), _param(m, name, "bias"),
                  (f"{name}.running_mean",) if getattr(m, "running_mean", None) is not None else ())
    if isinstance(m, _ZERO_PRESERVING_MODULES):
        return Op(name, "same", tensors, out)
    if isinstance(m, nn.Flatten) and m.start_dim == 1 and m.end_dim == -1:
        return Op(name, "flatten", tensors, out)
    return Op(f"{name} ({type(m).__name__})", "other", tensors, out)


def _param(m: nn.Module, name: str, attr: str) -> str | None:
    return f"{name}.{attr}" if getattr(m, attr, None) is not None else None


def _is_flatten(node: torch.fx.Node) -> bool:
    if node.op == "call_function" and node.target is torch.flatten:
        start = node.args[1] if len(node.args) > 1 else node.kwargs.get("start_dim", 0)
        return start == 1 and len(node.args) <= 2 and "end_dim" not in node.kwargs
    return node.op == "call_method" and node.target == "flatten" and tuple(node.args[1:]) == (1,)


def _is_global_mean(node: torch.fx.Node) -> bool:
    """``x.mean((2, 3))`` (a global average pool written out), keepdim or not."""
    if node.op == "call_method" and node.target == "mean" and len(node.args) == 2:
        dims = node.args[1]
        return isinstance(dims, (tuple, list)) and len(dims) >= 1 and all(isinstance(d, int) and d >= 2
                                                                           for d in dims)
    return False


def model_spaces(model: nn.Module) -> list[Space]:
    """``model``'s channel spaces from a ``torch.fx`` trace."""
    return channel_spaces(model_ops(model))


def model_graph(model: nn.Module, example_inputs: Any = None) -> ModelGraph:
    """``model``'s channel spaces and attentions: from ``torch.export`` on ``example_inputs`` when given or
    when the model is a Hugging Face one (which ``torch.fx`` cannot trace), else from ``torch.fx`` (no inputs
    needed; no attentions found)."""
    if example_inputs is not None or example_inputs_of(model) is not None:
        return exported_graph(model, example_inputs)
    try:
        return ModelGraph(model_spaces(model))
    except Exception as exc:  # any failure of the symbolic trace
        first = str(exc).splitlines()[0] if str(exc) else ""
        raise ValueError(f"torch.fx cannot trace {type(model).__name__} ({type(exc).__name__}: {first}); pass "
                         "example_inputs= (a batch of its inputs) to trace it with torch.export") from exc
