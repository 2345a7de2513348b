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
    """The tensor a ``get_attr`` node reads (onnx2torch keeps initializers as parameters or buffers), else None."""
    if not isinstance(node, torch.fx.Node) or node.op != "get_attr":
        return None
    try:
        return root.get_parameter(node.target)
    except AttributeError:
        return root.get_buffer(node.target)


def _op(root: torch.fx.GraphModule, node) -> object:
    """What an onnx2torch binary-op node computes (``torch.add``, ``torch.mul`` ...), else None."""
    if node is None or node.op != "call_module":
        return None
    return getattr(root.get_submodule(node.target), "math_op_function", None)


def _only_user(node):
    return next(iter(node.users)) if len(node.users) == 1 else None


def _constant_operand(root: torch.fx.GraphModule, node, source) -> torch.Tensor | None:
    """The constant ``node`` (a binary op reading ``source``) combines ``source`` with, else None."""
    if len(node.args) != 2 or source not in node.args:
        return None
    return _constant(root, node.args[1] if node.args[0] is source else node.args[0])


def _linears(root: torch.fx.GraphModule) -> int:
    """Each ``MatMul(x, W)`` whose only user is ``Add(., b)``, ``W`` and ``b`` constant, becomes ``nn.Linear``."""
    count = 0
    for node in list(root.graph.nodes):
        if node.op != "call_module" or type(root.get_submodule(node.target)).__name__ != "OnnxMatMul":
            continue
        weight, add = _constant(root, node.args[1]), _only_user(node)
        if weight is None or weight.dim() != 2 or _op(root, add) is not torch.add:
            continue
        bias = _constant_operand(root, add, node)
        if bias is None or bias.shape != (weight.shape[1],):
            continue
        linear = nn.Linear(weight.shape[0], weight.shape[1])
        with torch.no_grad():
            linear.weight.copy_(weight.t())
            linear.bias.copy_(bias)
        name = f"linear_{count}"
        root.add_module(name, linear)
        with root.graph.inserting_before(node):
            add.replace_all_uses_with(root.graph.call_module(name, (node.args[0],)))
        root.graph.erase_node(add)
        root.graph.erase_node(node)
        count += 1
    return count


def _affine_into_convs(root: torch.fx.GraphModule) -> int:
    """A conv followed by ``* a + b``, scalars (PP-LCNet's learnable affine block), folds into the conv's weight and
    bias: exact in float, and the conv's output is then the tensor the activation reads."""
    count = 0
    for node in list(root.graph.nodes):
        if node.op != "call_module" or not isinstance(root.get_submodule(node.target), nn.Conv2d):
            continue
        mul = _only_user(node)
        add = _only_user(mul) if _op(root, mul) is torch.mul else None
        if _op(root, add) is not torch.add:
            continue
        scale, shift = _constant_operand(root, mul, node), _constant_operand(root, add, mul)
        if scale is None or shift is None or scale.numel() != 1 or shift.numel() != 1:
            continue
        conv = root.get_submodule(node.target)
        with torch.no_grad():
            conv.weight.mul_(scale.reshape(()))
            bias = conv.bias if conv.bias is not None else torch.zeros(conv.out_channels)
            conv.bias = nn.Parameter(bias * scale.reshape(()) + shift.reshape(()))
        add.replace_all_uses_with(node)
        root.graph.erase_node(add)
        root.graph.erase_node(mul)
        count += 1
    return count


def torch_model(path: str | Path, height: int, width: int) -> torch.fx.GraphModule:
    """The ONNX model at ``path`` as an eval-mode ``torch.fx.GraphModule`` for ``height`` x ``width`` images."""
    _torchvision_stub()
    import onnx2torch

    module = onnx2torch.convert(_prepared(Path(path), height, width))
    _linears(module)
    _affine_into_convs(module)
    module.graph.eliminate_dead_code()  # the constants and modules the rewrites left unread
    module.delete_all_unused_submodules()
    module.recompile()
    return module.eval()
