"""What verification may hold at once, checked before anything runs: every tensor the model would make from one sample
of the verification inputs, by ONNX shape inference (data propagated, so a ``Tile`` or ``Expand`` of constant sizes
is known), within :data:`TENSOR_BYTES`.

A 1 kB model whose ``Tile`` makes a gigabyte per sample ran onnxruntime for a minute and ended "out of memory",
naming nothing. Refused here instead, naming the tensor, the node that makes it and its shape, in a fraction of a
second: the inputs (generated, or the user's) are what to change.
"""

from __future__ import annotations

import math

import numpy as np
import onnx
from onnx import helper

from .errors import ModelError

TENSOR_BYTES = 512 * 2**20  # one tensor, for one sample of the verification inputs, at most
SMALL_CONSTANT = 4096  # bytes: constants kept for shape inference (sizes, repeats, axes); larger ones become inputs


def check_tensor_sizes(model: onnx.ModelProto | str, feeds: dict[str, np.ndarray], batched: set[str],
                       fixed: int | None = None) -> None:
    """Refuse (:class:`ModelError`) a model that would make a tensor beyond :data:`TENSOR_BYTES` from one sample of
    ``feeds`` (the batch axis of the ``batched`` inputs taken as 1, or as the ``fixed`` batch the model runs at a
    time); a model shape inference cannot follow passes."""
    if isinstance(model, str):  # a file: its graph, not its weights (external data stays on disk)
        model = onnx.load(model, load_external_data=False)
    one = fixed or 1
    shapes = {name: [one, *np.shape(v)[1:]] if (name in batched or fixed) and np.ndim(v) else list(np.shape(v))
              for name, v in feeds.items()}
    try:
        inferred = onnx.shape_inference.infer_shapes(_skeleton(model, shapes), data_prop=True)
    except Exception:  # noqa: BLE001 - a model onnx cannot infer still runs: the budget is then onnxruntime's
        return
    makers = {out: node for node in inferred.graph.node for out in node.output}
    for info in list(inferred.graph.value_info) + list(inferred.graph.output):
        tensor = info.type.tensor_type
        dims = [d.dim_value if d.HasField("dim_value") else None for d in tensor.shape.dim]
        if not tensor.HasField("shape") or None in dims or tensor.elem_type == 0:
            continue
        size = math.prod(dims) * helper.tensor_dtype_to_np_dtype(tensor.elem_type).itemsize
        if size > TENSOR_BYTES:
            node = makers.get(info.name)
            made = f" (made by {node.op_type} {node.name!r})" if node is not None else ""
            raise ModelError(f"verification would make tensor {info.name!r}{made} of shape {dims}, "
                             f"{size / 2**20:,.0f} MB for one sample, beyond the {TENSOR_BYTES // 2**20} MB one "
                             "tensor may take; verify on smaller inputs (--input-shape NAME=D1,D2,... or "
                             "--inputs FILE.npz)")


def _skeleton(model: onnx.ModelProto, shapes: dict[str, list[int]]) -> onnx.ModelProto:
    """``model``'s graph with the inputs fixed to ``shapes`` and only its small constants (the sizes shape inference
    propagates); each larger initializer is an input of its shape, so no weight is copied."""
    graph = model.graph
    small, large = [], []
    for init in graph.initializer:
        (small if init.data_location != onnx.TensorProto.EXTERNAL and init.ByteSize() <= SMALL_CONSTANT
         else large).append(init)
    known = {i.name for i in graph.initializer}
    inputs = [helper.make_tensor_value_info(i.name, i.type.tensor_type.elem_type, shapes.get(i.name))
              if i.name in shapes else i for i in graph.input if i.name not in known]
    inputs += [helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)) for t in large]
    skeleton = helper.make_graph(list(graph.node), graph.name, inputs, list(graph.output), small)
    return helper.make_model(skeleton, opset_imports=list(model.opset_import), ir_version=model.ir_version,
                             functions=list(model.functions))
