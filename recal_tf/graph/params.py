"""Describe a TF graph's variables to the core: name, layer (scope) and whether it is a kernel."""

from __future__ import annotations

import tensorflow as tf

from recal_core.params import ParamInfo

# op type -> index of its weight input
KERNEL_INPUTS = {"Conv2D": 1, "Conv3D": 1, "DepthwiseConv2dNative": 1, "MatMul": 1, "Conv2DBackpropInput": 1,
                 "Conv1D": 1}
# op type -> the kernel's axes in canonical [out, in, *spatial] order (HWIO, DHWIO, [in, out]); ops not here
# (depthwise, transposed convs) take unstructured masks only
CANONICAL_AXES = {"Conv2D": (3, 2, 0, 1), "Conv3D": (4, 3, 0, 1, 2), "MatMul": (1, 0)}
_PASS_THROUGH = {"Identity", "ReadVariableOp", "Cast", "Enter"}
_VARIABLE_OPS = {"VarHandleOp", "VariableV2", "Variable"}


def _variable_op(tensor: tf.Tensor) -> tf.Operation | None:
    op = tensor.op
    while op.type in _PASS_THROUGH and op.inputs:
        op = op.inputs[0].op
    return op if op.type in _VARIABLE_OPS else None


def kernel_variable_ops(graph: tf.Graph) -> dict[str, tuple[int, ...] | None]:
    """The variable ops that feed a conv or matmul as its weight, each with its canonical axes (or None)."""
    names: dict[str, tuple[int, ...] | None] = {}
    for op in graph.get_operations():
        index = KERNEL_INPUTS.get(op.type)
        if index is not None and len(op.inputs) > index:
            var_op = _variable_op(op.inputs[index])
            if var_op is not None:
                axes = CANONICAL_AXES.get(op.type)
                if op.type == "MatMul" and (op.get_attr("transpose_b") if "transpose_b" in op.node_def.attr else False):
                    axes = (0, 1)
                names[var_op.name] = axes if names.get(var_op.name, axes) == axes else None
    return names


def variable_name(variable: tf.Variable) -> str:
    """``mnist_net/blocks/conv0/conv/weight`` for the variable ``mnist_net/blocks/conv0/conv/weight:0``."""
    return variable.op.name


def describe_variables(graph: tf.Graph, variables: list[tf.Variable]) -> tuple[list[ParamInfo], dict[str, tf.Variable]]:
    kernels = kernel_variable_ops(graph)
    infos, by_name = [], {}
    for v in variables:
        name = variable_name(v)
        shape = tuple(int(d) for d in v.shape.as_list())
        infos.append(ParamInfo(name, name.rpartition("/")[0], name in kernels, shape, kernels.get(name)))
        by_name[name] = v
    return infos, by_name
