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

from .errors import ModelError

INPUT_BYTES = 256 * 2**20  # the generated verification inputs, all of them, at most
SPATIAL = 32  # a dimension the model leaves open on an image's height or width (rank 4: axes 2 and 3)
SEQUENCE = 16  # ... any other open dimension but the batch (a sequence's length)
_SPATIAL_NAMES = ("height", "width", "h", "w", "image", "spatial", "size")
_SEQUENCE_NAMES = ("seq", "sequence", "length", "len", "time", "frames", "tokens", "steps", "past")

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


def generated_inputs(model: onnx.ModelProto, batch: int = 256, seed: int = 0,
                     shapes: dict[str, list[int]] | None = None) -> dict[str, np.ndarray]:
    """Standard-normal float inputs; a batch the model leaves open becomes ``batch`` samples, a fixed batch
    (:func:`fixed_batch`) is repeated up to ``batch`` samples, and every other open dimension (symbolic, unnamed,
    or declared -1) a size that exercises the model (:func:`open_dimension`), the same for every input that shares
    its name; ``shapes`` (the user's ``--input-shape``) gives an input's whole shape, its first dimension the
    batch. Integer inputs: uniform over the table
    they index (a ``Gather``'s size: token ids cover the vocabulary), ones for an input named like a mask
    (attention masks), otherwise {0, 1}.

    Args:
        model: the model whose inputs are made.
        batch: samples where the batch is open.
        seed: the generator's seed.
        shapes: an input's whole shape by name (its first dimension the batch).
    """
    rng = np.random.default_rng(seed)
    ranges = integer_ranges(model)
    fixed = fixed_batch(model)
    given = shapes or {}
    check_input_names(model, given, "input_shapes")
    shapes = _declared(model, fixed, given)
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


def check_input_names(model: onnx.ModelProto, named: dict | None, what: str, label: str = "the model") -> None:
    """A ValueError naming what ``named`` (``inputs`` or ``input_shapes``) names that ``model`` does not take."""
    takes = [i.name for i in model.graph.input]
    unknown = sorted(set(named or {}) - set(takes))
    if unknown:
        raise ValueError(f"{what} names {', '.join(map(repr, unknown))}, which {label} does not take (its inputs: "
                         f"{', '.join(map(repr, takes))})")


def open_dimension(name: str, axis: int, rank: int, floating: bool) -> int:
    """The size generated inputs give a dimension the model leaves open (not the batch): what its name says
    (height, width: :data:`SPATIAL`; sequence, length, time: :data:`SEQUENCE`), else :data:`SPATIAL` for an image's
    last two axes (a float input of rank 4) and :data:`SEQUENCE` for any other. Never 1 (a 1x1 image reaches no
    layer as it would run) and never negative."""
    words = name.lower().replace("-", "_").replace(".", "_").split("_")
    if any(w in _SPATIAL_NAMES for w in words):
        return SPATIAL
    if any(w in _SEQUENCE_NAMES for w in words):
        return SEQUENCE
    return SPATIAL if floating and rank == 4 and axis >= 2 else SEQUENCE


def _declared(model: onnx.ModelProto, fixed: int | None,
              given: dict[str, list[int]] | None = None) -> dict[str, tuple[list[int], type, bool]]:
    """Per graph input to generate: its dims for one sample (an open first dim, the batch, 1; a fixed batch whole;
    other open dims :func:`open_dimension`, shared by name), its numpy type, whether its first dim is the batch."""
    initializers = {t.name for t in model.graph.initializer}
    shapes, named = {}, {}
    for info in model.graph.input:
        if info.name in initializers:
            continue
        tensor = info.type.tensor_type
        dtype = _NP_TYPES.get(tensor.elem_type, np.float32)
        if info.name in (given or {}):
            dims = [int(d) for d in given[info.name]]
            if len(dims) != len(tensor.shape.dim) and tensor.HasField("shape"):
                raise ValueError(f"input shape {dims} given for {info.name!r}, which has rank {len(tensor.shape.dim)}")
            if any(d < 1 for d in dims):
                raise ValueError(f"input shape {dims} given for {info.name!r}: every dimension must be at least 1")
            one = [1] + dims[1:] if fixed is None and dims else dims  # one sample; the batch is the generator's
            shapes[info.name] = one, dtype, bool(dims)
            continue
        dims = []
        for axis, d in enumerate(tensor.shape.dim):
            if d.HasField("dim_value") and d.dim_value >= 0:
                dims.append(d.dim_value)
            elif axis == 0:
                dims.append(1)
            else:
                key = d.dim_param or f"{info.name}:{axis}"
                named.setdefault(key, open_dimension(d.dim_param, axis, len(tensor.shape.dim),
                                                     np.issubdtype(dtype, np.floating)))
                dims.append(named[key])
        first = tensor.shape.dim[0] if tensor.shape.dim else None
        batched = bool(dims) and (fixed is not None or not (first.HasField("dim_value") and first.dim_value >= 0))
        shapes[info.name] = dims, dtype, batched
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


def chosen_dimensions(model: onnx.ModelProto) -> bool:
    """Whether generated inputs choose a size the model leaves open beyond the batch (:func:`open_dimension`)."""
    return any(not (d.HasField("dim_value") and d.dim_value >= 0)
               for i in model.graph.input for d in list(i.type.tensor_type.shape.dim)[1:])


def batched_inputs(model: onnx.ModelProto) -> set[str]:
    """The inputs whose first dimension is not fixed (a batch the verification may split)."""
    return {i.name for i in model.graph.input if i.type.tensor_type.shape.dim
            and not i.type.tensor_type.shape.dim[0].dim_value > 0}


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
        if not dims or not dims[0].dim_value > 0:
            return None
        firsts.add(dims[0].dim_value)
    return firsts.pop() if len(firsts) == 1 else None
