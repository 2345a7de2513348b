"""A pretrained ONNX model as a PyTorch module recal can train: onnx2torch's conversion, with the layers QAT needs in
the form it plans (a ``MatMul`` by a constant plus a constant ``Add`` becomes the ``nn.Linear`` it is).

onnx2torch is the package index's ONNX-to-PyTorch converter. It imports torchvision for two operators these models do
not have (``NonMaxSuppression``, ``RoiAlign``); torchvision's wheels are built for another torch, so a stub that
refuses those two stands in for it (install onnx2torch with ``pip install --no-deps onnx2torch``).
"""

from __future__ import annotations

import sys
import types
from pathlib import Path

import torch
from torch import nn


def _torchvision_stub() -> None:
    if "torchvision" in sys.modules:
        return

    def refused(*_args, **_kwargs):
        raise NotImplementedError("torchvision is not installed: NonMaxSuppression and RoiAlign cannot run")

    ops = types.ModuleType("torchvision.ops")
    ops.nms = ops.box_convert = ops.roi_align = refused
    package = types.ModuleType("torchvision")
    package.ops = ops
    sys.modules.update({"torchvision": package, "torchvision.ops": ops})


def _prepared(path: Path, height: int, width: int):
    """The file with its ``Constant`` nodes as initializers (onnx2torch reads weights from initializers only) and
    every shape inferred for a ``height`` x ``width`` input (onnx2torch picks a BatchNorm's class by its rank)."""
    import onnx
    from onnxruntime.tools.symbolic_shape_infer import SymbolicShapeInference

    model = onnx.load(str(path))
    nodes = []
    for node in model.graph.node:
        if node.op_type == "Constant" and node.attribute[0].name == "value":
            tensor = node.attribute[0].t
            tensor.name = node.output[0]
            model.graph.initializer.append(tensor)
        else:
            nodes.append(node)
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    dims = model.graph.input[0].type.tensor_type.shape.dim
    dims[0].dim_param = "batch"
    dims[2].dim_value, dims[3].dim_value = height, width
    return SymbolicShapeInference.infer_shapes(model, auto_merge=True)


def _constant(root: torch.fx.GraphModule, node) -> torch.Tensor | None:
    if isinstance(node, torch.fx.Node) and node.op == "get_attr":
        return root.get_parameter(node.target) if node.target in dict(root.named_parameters()) else \
            root.get_buffer(node.target)
    return None


def _linears(root: torch.fx.GraphModule) -> int:
    """Each ``MatMul(x, W)`` whose only user is ``Add(., b)``, ``W`` and ``b`` constant, becomes ``nn.Linear``."""
    count = 0
    for node in list(root.graph.nodes):
        if node.op != "call_module" or type(root.get_submodule(node.target)).__name__ != "OnnxMatMul":
            continue
        weight = _constant(root, node.args[1])
        users = list(node.users)
        if weight is None or weight.dim() != 2 or len(users) != 1 or users[0].op != "call_module":
            continue
        add = users[0]
        adder = root.get_submodule(add.target)
        if getattr(adder, "math_op_function", None) is not torch.add:
            continue
        bias = _constant(root, add.args[1] if add.args[0] is node else add.args[0])
        if bias is None or bias.shape != (weight.shape[1],):
            continue
        linear = nn.Linear(weight.shape[0], weight.shape[1])
        with torch.no_grad():
            linear.weight.copy_(weight.t())
            linear.bias.copy_(bias)
        name = f"linear_{count}"
        root.add_module(name, linear)
        with root.graph.inserting_before(node):
            replacement = root.graph.call_module(name, (node.args[0],))
        add.replace_all_uses_with(replacement)
        root.graph.erase_node(add)
        root.graph.erase_node(node)
        count += 1
    root.graph.eliminate_dead_code()
    root.delete_all_unused_submodules()
    root.recompile()
    return count


def _scalar_operand(root: torch.fx.GraphModule, node, source) -> torch.Tensor | None:
    """The scalar constant ``node`` (a single-input binary op of ``source``) multiplies or adds, else None."""
    if node.op != "call_module" or len(node.args) != 2 or source not in node.args:
        return None
    other = _constant(root, node.args[1] if node.args[0] is source else node.args[0])
    return other if other is not None and other.numel() == 1 else None


def _affine_into_convs(root: torch.fx.GraphModule) -> int:
    """A conv followed by ``* a + b``, scalars (PP-LCNet's learnable affine block), folds into the conv's weight and
    bias: exact in float, and the conv's output is then the tensor the activation reads."""
    count = 0
    for node in list(root.graph.nodes):
        if node.op != "call_module" or not isinstance(root.get_submodule(node.target), nn.Conv2d):
            continue
        conv, users = root.get_submodule(node.target), list(node.users)
        mul = users[0] if len(users) == 1 else None
        if mul is None or getattr(root.get_submodule(mul.target), "math_op_function", None) is not torch.mul:
            continue
        scale = _scalar_operand(root, mul, node)
        add = list(mul.users)[0] if len(mul.users) == 1 else None
        if scale is None or add is None or \
                getattr(root.get_submodule(add.target), "math_op_function", None) is not torch.add:
            continue
        shift = _scalar_operand(root, add, mul)
        if shift is None:
            continue
        with torch.no_grad():
            conv.weight.mul_(scale.reshape(()))
            bias = conv.bias if conv.bias is not None else torch.zeros(conv.out_channels)
            conv.bias = nn.Parameter(bias * scale.reshape(()) + shift.reshape(()))
        add.replace_all_uses_with(node)
        root.graph.erase_node(add)
        root.graph.erase_node(mul)
        count += 1
    root.graph.eliminate_dead_code()
    root.recompile()
    return count


def torch_model(path: str | Path, height: int, width: int) -> torch.fx.GraphModule:
    """The ONNX model at ``path`` as an eval-mode ``torch.fx.GraphModule`` for ``height`` x ``width`` images."""
    _torchvision_stub()
    import onnx2torch

    module = onnx2torch.convert(_prepared(Path(path), height, width))
    _linears(module)
    _affine_into_convs(module)
    return module.eval()
