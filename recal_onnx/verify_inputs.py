"""What the verification runs two models on: inputs made from a model's own declarations, when the user gives none.

Float inputs are standard normal; an integer input that indexes a table covers the table (token ids, the
vocabulary); a mask is ones. A model whose inputs fix their batch (what torch.onnx, Brevitas, NNCF, AIMET and ModelOpt
write by default) gets as many batches as reach the sample count, run one batch at a time. What an input declares
is bounded before anything is allocated (:data:`INPUT_BYTES`): fewer samples where 256 would not fit (said in a
warning), a located refusal where one does not.
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import onnx

from .input_checks import ModelError

INPUT_BYTES = 256 * 2**20  # the generated verification inputs, all of them, at most

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
    ranges = integer_ranges(model)
    fixed = fixed_batch(model)
    shapes = _declared(model, fixed)
    batch = _samples_that_fit(shapes, batch, fixed)
    feeds = {}
    for name, (dims, dtype, batched) in shapes.items():
        dims = list(dims)
        if fixed:  # a fixed batch: as many batches as reach ``batch`` samples, run one at a time
            dims[0] = -(-batch // fixed) * fixed
        elif batched:
            dims[0] = batch
        if np.issubdtype(dtype, np.floating):
            feeds[name] = rng.standard_normal(dims).astype(dtype)
        elif name in ranges and ranges[name] > 0:
            feeds[name] = rng.integers(0, ranges[name], dims).astype(dtype)
        elif "mask" in name.lower():
            feeds[name] = np.ones(dims, dtype)
        else:
            feeds[name] = rng.integers(0, 2, dims).astype(dtype)
    return feeds


def _declared(model: onnx.ModelProto, fixed: int | None) -> dict[str, tuple[list[int], type, bool]]:
    """Per graph input to generate: its dims for one sample (a symbolic first dim 1, other symbolic dims 1; a fixed
    batch whole), its numpy type, whether its first dim is the batch."""
    initializers = {t.name for t in model.graph.initializer}
    shapes = {}
    for info in model.graph.input:
        if info.name in initializers:
            continue
        tensor = info.type.tensor_type
        dims = [d.dim_value if d.HasField("dim_value") else 1 for d in tensor.shape.dim]
        batched = bool(dims) and (fixed is not None or not tensor.shape.dim[0].HasField("dim_value"))
        shapes[info.name] = dims, _NP_TYPES.get(tensor.elem_type, np.float32), batched
    return shapes


def _samples_that_fit(shapes: dict[str, tuple[list[int], type, bool]], batch: int, fixed: int | None) -> int:
    """``batch``, or the most samples whose inputs fit :data:`INPUT_BYTES` (with a warning that says so); refused,
    naming the largest input and its declared shape, where one sample (or one fixed batch) does not fit."""
    one = {name: math.prod(max(d, 0) for d in dims) * np.dtype(dtype).itemsize
           for name, (dims, dtype, _) in shapes.items()}
    unit = sum(one.values())  # bytes of one sample, or of one fixed batch
    if unit > INPUT_BYTES:
        name = max(one, key=one.get)
        what = f"one batch of {fixed}" if fixed else "one sample"
        raise ModelError(f"input {name!r} declares shape {shapes[name][0]}: {one[name] / 2**20:.4g} MB for {what}, "
                         f"beyond the {INPUT_BYTES // 2**20} MB the generated verification inputs may take; pass "
                         "inputs of a size that runs (quantize_qat_export(..., inputs={name: array}))")
    per = fixed or 1
    units = -(-batch // per)
    fits = max(1, min(units, INPUT_BYTES // max(unit, 1)))
    if fits < units:
        warnings.warn(f"verification on {fits * per} generated samples, not {batch}: one sample's inputs take "
                      f"{unit / per / 2**20:.3g} MB and all of them at most {INPUT_BYTES // 2**20} MB", stacklevel=3)
    return min(batch, fits * per)


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
