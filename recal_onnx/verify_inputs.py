"""What the verification runs two models on: inputs made from a model's own declarations, when the user gives none.

Float inputs are standard normal; an integer input that indexes a table covers the table (token ids, the
vocabulary); a mask is ones. A model whose inputs fix their batch (what torch.onnx, Brevitas, NNCF, AIMET and ModelOpt
write by default) gets as many batches as reach the sample count, run one batch at a time.
"""

from __future__ import annotations

import numpy as np
import onnx

_NP_TYPES = {onnx.TensorProto.FLOAT: np.float32, onnx.TensorProto.DOUBLE: np.float64,
             onnx.TensorProto.INT64: np.int64, onnx.TensorProto.INT32: np.int32, onnx.TensorProto.UINT8: np.uint8,
             onnx.TensorProto.INT8: np.int8, onnx.TensorProto.FLOAT16: np.float16, onnx.TensorProto.BOOL: np.bool_}


def integer_ranges(model: onnx.ModelProto) -> dict[str, int]:
    """Per integer graph input that indexes a table (``Gather``'s indices, directly or through a ``Cast``,
    ``Reshape``, ``Unsqueeze``, ``Squeeze`` or ``Identity``): the table's size along the gathered axis."""
    shapes = {t.name: list(t.dims) for t in model.graph.initializer}
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for node in model.graph.node:  # graph order: a (quantized) table's DequantizeLinear comes before its Gather
        for name in node.input:
            consumers.setdefault(name, []).append(node)
        if node.op_type in ("DequantizeLinear", "Identity", "Cast") and node.input and node.input[0] in shapes:
            shapes[node.output[0]] = shapes[node.input[0]]
    ranges = {}
    for info in model.graph.input:
        stack, seen = [info.name], set()
        while stack:
            name = stack.pop()
            if name in seen:
                continue
            seen.add(name)
            for node in consumers.get(name, []):
                if node.op_type == "Gather" and len(node.input) > 1 and node.input[1] == name \
                        and node.input[0] in shapes:
                    axis = next((a.i for a in node.attribute if a.name == "axis"), 0)
                    table = shapes[node.input[0]]
                    size = table[axis % len(table)] if table else 0
                    ranges[info.name] = min(ranges.get(info.name, size), size)
                elif node.op_type in ("Cast", "Reshape", "Unsqueeze", "Squeeze", "Identity") and node.input[0] == name:
                    stack.extend(node.output)
    return ranges


def generated_inputs(model: onnx.ModelProto, batch: int = 256, seed: int = 0) -> dict[str, np.ndarray]:
    """Standard-normal float inputs; symbolic dims become ``batch``/1, a fixed batch (:func:`fixed_batch`) is
    repeated up to ``batch`` samples. Integer inputs: uniform over the table
    they index (a ``Gather``'s size: token ids cover the vocabulary), ones for an input named like a mask
    (attention masks), otherwise {0, 1}."""
    rng = np.random.default_rng(seed)
    initializers = {t.name for t in model.graph.initializer}
    ranges = integer_ranges(model)
    fixed = fixed_batch(model)
    feeds = {}
    for info in model.graph.input:
        if info.name in initializers:
            continue
        tensor = info.type.tensor_type
        dims = [d.dim_value if d.HasField("dim_value") else (batch if i == 0 else 1)
                for i, d in enumerate(tensor.shape.dim)]
        if fixed:  # a fixed batch: as many batches as reach ``batch`` samples, run one at a time
            dims[0] = -(-batch // fixed) * fixed
        dtype = _NP_TYPES.get(tensor.elem_type, np.float32)
        if np.issubdtype(dtype, np.floating):
            feeds[info.name] = rng.standard_normal(dims).astype(dtype)
        elif info.name in ranges and ranges[info.name] > 0:
            feeds[info.name] = rng.integers(0, ranges[info.name], dims).astype(dtype)
        elif "mask" in info.name.lower():
            feeds[info.name] = np.ones(dims, dtype)
        else:
            feeds[info.name] = rng.integers(0, 2, dims).astype(dtype)
    return feeds


def batched_inputs(model: onnx.ModelProto) -> set[str]:
    """The inputs whose first dimension is not fixed (a batch the verification may split)."""
    return {i.name for i in model.graph.input if i.type.tensor_type.shape.dim
            and not i.type.tensor_type.shape.dim[0].HasField("dim_value")}


def fixed_batch(model: onnx.ModelProto) -> int | None:
    """The batch every input of ``model`` fixes (torch.onnx, Brevitas, NNCF, AIMET and ModelOpt export a fixed
    batch by default): the first dimension, the same fixed size on each input; None otherwise. The verification
    then runs as many such batches as it takes to reach its sample count."""
    initializers = {t.name for t in model.graph.initializer}
    firsts = set()
    for info in model.graph.input:
        if info.name in initializers:
            continue
        dims = info.type.tensor_type.shape.dim
        if not dims or not dims[0].HasField("dim_value") or dims[0].dim_value < 1:
            return None
        firsts.add(dims[0].dim_value)
    return firsts.pop() if len(firsts) == 1 else None
