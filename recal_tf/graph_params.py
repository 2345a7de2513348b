"""Describe a TF graph's variables to the core: name, layer (scope) and whether it is a kernel."""

from __future__ import annotations

import tensorflow as tf

from recal_core.params import ParamInfo

# op type -> index of its weight input
KERNEL_INPUTS = {"Conv2D": 1, "Conv3D": 1, "DepthwiseConv2dNative": 1, "MatMul": 1, "Conv2DBackpropInput": 1,
                 "Conv1D": 1}
_PASS_THROUGH = {"Identity", "ReadVariableOp", "Cast", "Enter"}
_VARIABLE_OPS = {"VarHandleOp", "VariableV2", "Variable"}


def _variable_op(tensor: tf.Tensor) -> tf.Operation | None:
    op = tensor.op
    while op.type in _PASS_THROUGH and op.inputs:
        op = op.inputs[0].op
    return op if op.type in _VARIABLE_OPS else None


def kernel_variable_ops(graph: tf.Graph) -> set[str]:
    """Names of the variable ops that feed a conv or matmul as its weight."""
    names = set()
    for op in graph.get_operations():
        index = KERNEL_INPUTS.get(op.type)
        if index is not None and len(op.inputs) > index:
            var_op = _variable_op(op.inputs[index])
            if var_op is not None:
                names.add(var_op.name)
    return names


def variable_name(variable: tf.Variable) -> str:
    """``mnist_net/blocks/conv0/conv/weight`` for the variable ``mnist_net/blocks/conv0/conv/weight:0``."""
    return variable.op.name


def describe_variables(graph: tf.Graph, variables: list[tf.Variable]) -> tuple[list[ParamInfo], dict[str, tf.Variable]]:
    kernels = kernel_variable_ops(graph)
    infos, by_name = [], {}
    for v in variables:
        name = variable_name(v)
        infos.append(ParamInfo(name, name.rpartition("/")[0], name in kernels))
        by_name[name] = v
    return infos, by_name
