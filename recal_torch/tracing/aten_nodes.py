"""What an ATen node of a ``torch.export`` graph is, as the coupling reads it: a linear (and the weight and bias
behind it), a convolution, a view, a zero-preserving elementwise op; its shape and where in the model it is."""

from __future__ import annotations

from typing import Any

import torch




aten = torch.ops.aten


SAME = {aten.gelu.default, aten.relu.default, aten.relu_.default, aten.silu.default, aten.tanh.default,
         aten.dropout.default, aten.clone.default, aten.contiguous.default, aten.alias.default,
         aten.hardtanh.default, aten.relu6.default, aten.leaky_relu.default, aten.hardswish.default,
         aten.detach.default,
         aten._to_copy.default, aten.to.dtype, aten.type_as.default, aten.native_dropout.default}


# a QAT model's fake quantizers: a weight's (per channel) is the weight to the graph; an activation's (per
# tensor) keeps every channel and head where it is
FAKE_QUANTS = {aten.fake_quantize_per_channel_affine.default, aten.fake_quantize_per_tensor_affine.default,
                aten.fake_quantize_per_tensor_affine.tensor_qparams}


CONVS = {aten.conv1d.default, aten.conv2d.default, aten.conv3d.default}


JOIN = {aten.add.Tensor, aten.mul.Tensor}


# ops that compute an elementwise function of one tensor (and numbers): a gate such as GELU's ``1 + tanh(...)``
ELEMENTWISE = {aten.add.Tensor, aten.sub.Tensor, aten.mul.Tensor, aten.div.Tensor, aten.pow.Tensor_Scalar,
                aten.tanh.default, aten.sigmoid.default, aten.erf.default, aten.exp.default, aten.neg.default,
                aten.rsub.Scalar, aten.add.Scalar, aten.mul.Scalar}


# a weight transposed for ``x @ w.T`` (transformers' FalconLinear): the weight
TRANSPOSES = {aten.t.default, aten.transpose.int, aten.permute.default, aten.numpy_T.default}


VIEWS = {aten.view.default, aten.reshape.default, aten._unsafe_view.default}


MERGE = {aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.transpose.int,
          aten.permute.default, aten.contiguous.default, aten.clone.default, aten.alias.default, *FAKE_QUANTS}


def projection_of(node: torch.fx.Node, params: dict[str, str]) -> tuple[torch.fx.Node, torch.fx.Node, Any] | None:
    """``(input, weight, bias)`` of a ``linear`` or a transformers Conv1D's ``addmm(bias, x, weight)`` on a
    parameter (None for anything else)."""
    if node.target is aten.linear.default and node.args[1].name in params:
        return node.args[0], node.args[1], node.args[2] if len(node.args) > 2 else None
    if node.target is aten.addmm.default and isinstance(node.args[2], torch.fx.Node) \
            and node.args[2].name in params and not node.kwargs:
        return node.args[1], node.args[2], node.args[0]
    if matmul_on_weight(node, params) and bias_add_of(node, params) is None:
        return node.args[0], node.args[1], None
    if node.target is aten.add.Tensor and len(node.args) == 2 and isinstance(node.args[0], torch.fx.Node) \
            and matmul_on_weight(node.args[0], params) and bias_add_of(node.args[0], params) is node:
        return node.args[0].args[0], node.args[0].args[1], node.args[1]
    return None


def matmul_on_weight(node: torch.fx.Node, params: dict[str, str]) -> bool:
    """``x @ w.T`` on a parameter ``w`` (a FalconLinear)."""
    weight = node.args[1] if node.target is aten.matmul.default and len(node.args) == 2 else None
    return isinstance(weight, torch.fx.Node) and weight.target in TRANSPOSES and weight.name in params


def bias_add_of(matmul: torch.fx.Node, params: dict[str, str]) -> torch.fx.Node | None:
    """The ``+ bias`` (a one-axis parameter) that alone reads a matmul's output: part of the layer."""
    users = list(matmul.users)
    if len(users) != 1 or users[0].target is not aten.add.Tensor or len(users[0].args) != 2 \
            or users[0].args[0] is not matmul:
        return None
    bias = users[0].args[1]
    return users[0] if isinstance(bias, torch.fx.Node) and bias.name in params and len(shape_of(bias) or ()) == 1 \
        else None


def is_spatial(node: torch.fx.Node) -> bool:
    dims, rank = node.args[1] if len(node.args) > 1 else None, len(shape_of(node.args[0]) or ())
    return isinstance(dims, (list, tuple)) and bool(dims) and all(2 <= (d + rank if d < 0 else d) < rank
                                                                   for d in dims)


def where_of(node: torch.fx.Node) -> str:
    stack = node.meta.get("nn_module_stack") or {}
    module = list(stack.values())[-1][0] if stack else ""
    return f"{module} ({node.target})" if module else str(node.target)


def shape_of(node: Any) -> tuple[int, ...] | None:
    val = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return tuple(val.shape) if isinstance(val, torch.Tensor) else None


PADS = {aten.constant_pad_nd.default, aten.pad.default}


def pads_only_space(node: torch.fx.Node) -> bool:
    """A pad of an image's borders alone, with zeros (or by reflection or replication): a channel of zeros stays
    zeros, and the channel axis is not padded (TensorFlow-style "same" padding, written before a convolution)."""
    pad, rank = node.args[1], len(shape_of(node.args[0]) or ())
    if node.target is aten.pad.default:
        mode = node.args[2] if len(node.args) > 2 else node.kwargs.get("mode", "constant")
        value = node.args[3] if len(node.args) > 3 else node.kwargs.get("value")
    else:
        mode, value = "constant", node.args[2] if len(node.args) > 2 else node.kwargs.get("value", 0)
    return rank > 2 and len(pad) <= 2 * (rank - 2) and (mode != "constant" or not value)


def same_shape(node: torch.fx.Node, *inputs: torch.fx.Node) -> bool:
    out = shape_of(node)
    return out is not None and all(shape_of(i) == out for i in inputs)


def is_tensor(arg: Any) -> bool:
    return isinstance(arg, torch.fx.Node)


def position_of(node: torch.fx.Node) -> int:
    return 0 if is_tensor(node.args[0]) else 1
