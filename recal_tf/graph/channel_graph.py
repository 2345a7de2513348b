"""A TensorFlow graph as the core's channel-coupling ops (:mod:`recal_core.channel_coupling`): which
kernels share channels, for filter and channel pruning in the graph API.

Only the forward graph counts: gradient (``gradients/``) and recal's own ops are left out, and a tensor
no forward op reads is a model output. Channels are NHWC's last axis; a ``Reshape`` (TensorFlow flattens
channels last, interleaved) is an op the rules do not cover.
"""

from __future__ import annotations

import tensorflow as tf

from recal_core.channel_coupling import Op, Space, channel_spaces

from .params import _variable_op

_SAME = {"Relu", "Relu6", "Elu", "Selu", "LeakyRelu", "Tanh", "MaxPool", "AvgPool", "Identity", "StopGradient"}
_NORMS = {"FusedBatchNorm", "FusedBatchNormV2", "FusedBatchNormV3"}
_SKIPPED = {"Const", "VarHandleOp", "ReadVariableOp", "VariableV2", "NoOp", "Placeholder"}


def _forward(op: tf.Operation) -> bool:
    parts = op.name.split("/")
    return "gradients" not in parts and parts[0] != "recal" and not op.type.startswith(("Assign", "Apply",
                                                                                          "ResourceApply"))


def _var(tensor: tf.Tensor) -> str | None:
    op = _variable_op(tensor)
    return None if op is None else op.name


def graph_ops(graph: tf.Graph) -> list[Op]:
    """``graph``'s forward ops for the coupling rules."""
    ops: list[Op] = []
    read: set[str] = set()
    produced: list[str] = []
    for op in graph.get_operations():
        if not _forward(op):
            continue
        if op.type == "Placeholder":
            ops.append(Op(op.name, "input", (), op.outputs[0].name))
            continue
        if op.type in _SKIPPED or not op.outputs or _variable_op(op.outputs[0]) is not None:
            continue  # constants, variables and their reads: weights, not activations
        data = tuple(t.name for t in op.inputs if _var(t) is None and t.op.type != "Const"
                     and t.dtype.is_floating)
        read.update(data)
        out = op.outputs[0].name
        produced.append(out)
        ops.append(_op(op, data, out))
    dangling = tuple(t for t in produced if t not in read)
    ops.append(Op("the model's output", "output", dangling))  # tensors no forward op reads
    return ops


def _op(op: tf.Operation, data: tuple[str, ...], out: str) -> Op:
    t = op.type
    if t in ("Conv2D", "MatMul") and len(op.inputs) > 1 and _var(op.inputs[1]) and len(data) == 1:
        if t == "MatMul" and (op.get_attr("transpose_a") or op.get_attr("transpose_b")):
            return Op(op.name, "other", data, out)
        return Op(_var(op.inputs[1]), "layer", data, out, _var(op.inputs[1]))  # named as params name it
    if t == "DepthwiseConv2dNative" and _var(op.inputs[1]) and op.inputs[1].shape[-1] == 1 and len(data) == 1:
        return Op(_var(op.inputs[1]), "depthwise", data, out, _var(op.inputs[1]))
    if t == "BiasAdd" and _var(op.inputs[1]) and len(data) == 1:
        return Op(op.name, "norm", data, out, None, _var(op.inputs[1]))
    if t in _NORMS and len(data) == 1:
        mean = _var(op.inputs[3]) if len(op.inputs) > 3 else None
        return Op(op.name, "norm", data, out, _var(op.inputs[1]), _var(op.inputs[2]), (mean,) if mean else ())
    if t in ("Select", "SelectV2") and len(data) == 2:
        return Op(op.name, "add", data, out)  # tf.where(training, batch-norm in training, in inference)
    if t in ("AddV2", "Add") and len(data) == 2:
        return Op(op.name, "add", data, out)
    if t in _SAME and len(data) == 1:
        return Op(op.name, "same", data, out)
    if t == "Mean" and len(data) == 1 and _spatial(op):
        return Op(op.name, "same", data, out)
    return Op(f"{op.name} ({t})", "other", data, out)


def _spatial(op: tf.Operation) -> bool:
    """A mean over NHWC's spatial axes (a global average pool)."""
    axes = tf.get_static_value(op.inputs[1])
    rank = op.inputs[0].shape.rank
    if axes is None or rank is None:
        return False
    axes = [int(a) + rank if int(a) < 0 else int(a) for a in ([axes] if axes.ndim == 0 else axes)]
    return bool(axes) and all(1 <= a < rank - 1 for a in axes)


def graph_spaces(graph: tf.Graph) -> list[Space]:
    return channel_spaces(graph_ops(graph))
