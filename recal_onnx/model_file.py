"""Reading the input model (with its external data, refusing what is not a regular file) and the shape inference
the converted model is checked with, on a weightless skeleton so that large initializers are never copied."""

from __future__ import annotations

import os
from pathlib import Path

import onnx

from recal_core.input_gate import regular_file

from .errors import ModelError
from .ir_edits import MS_DOMAIN


def infer_shapes_in_place(model: onnx.ModelProto, check: bool = False) -> None:
    """Shape inference (and ``onnx.checker`` with ``check``) on a weightless skeleton of ``model``, so
    large initializers are never copied; the inferred value_info is written back into ``model``."""
    from onnx import helper

    graph = model.graph
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 1)
    small, big = [], []
    for tensor in graph.initializer:
        (big if tensor.ByteSize() > 4096 else small).append(tensor)
    stand_ins = [helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)) for t in big]
    given = {i.name for i in graph.input}
    skeleton = helper.make_model(
        helper.make_graph([_as_standard(n, opset) for n in graph.node], graph.name or "graph",
                          list(graph.input) + [v for v in stand_ins if v.name not in given], list(graph.output), small),
        opset_imports=list(model.opset_import), ir_version=model.ir_version)
    inferred = onnx.shape_inference.infer_shapes(skeleton)
    if check:
        for output in inferred.graph.output:  # declared without a shape, after a contrib op shape inference does not
            if output.type.HasField("tensor_type") and not output.type.tensor_type.HasField("shape"):  # know: the
                output.type.tensor_type.shape.SetInParent()  # checker wants the field (this copy only is checked)
        onnx.checker.check_model(inferred)
    del graph.value_info[:]
    graph.value_info.extend(inferred.graph.value_info)


def _as_standard(node: onnx.NodeProto, opset: int) -> onnx.NodeProto:
    """onnxruntime's ``com.microsoft`` QuantizeLinear / DequantizeLinear as the default domain's, whose output shapes
    shape inference knows (the same shapes); any other node as it is."""
    if node.domain != MS_DOMAIN or node.op_type not in ("QuantizeLinear", "DequantizeLinear"):
        return node
    if opset < 13 and any(a.name == "axis" for a in node.attribute):  # per channel: the default domain's from 13
        return node
    copy = onnx.NodeProto()
    copy.CopyFrom(node)
    copy.domain = ""
    return copy


def load_model(model_or_path) -> tuple[onnx.ModelProto, set[Path]]:
    """The model, and the files it was read from (the model file and its external data), resolved."""
    if isinstance(model_or_path, onnx.ModelProto):
        return model_or_path, set()
    if not isinstance(model_or_path, (str, os.PathLike)):
        raise TypeError(f"expected an onnx.ModelProto or a path, not {type(model_or_path).__name__}")
    path = Path(model_or_path)
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such ONNX file")
    regular_file(path, "ONNX model")  # a FIFO or a device would block or never end the read
    try:
        model = onnx.load(str(path), load_external_data=False)
    except Exception as exc:  # noqa: BLE001 - protobuf raises several types for a bad file
        raise ModelError(f"{path} is not a readable ONNX model ({type(exc).__name__}: {exc})") from None
    reads = {path.resolve()}
    for tensor in _tensors(model.graph):
        if tensor.data_location == onnx.TensorProto.EXTERNAL:
            location = next((e.value for e in tensor.external_data if e.key == "location"), "")
            reads.add((path.parent / location).resolve())
    for data in reads - {path.resolve()}:
        if data.exists():
            regular_file(data, "external data file of the ONNX model")
    if len(reads) > 1:
        try:
            onnx.load_external_data_for_model(model, str(path.parent))
        except Exception as exc:  # noqa: BLE001 - a missing, short or escaping data file
            raise ModelError(f"{path}: cannot read its external data ({type(exc).__name__}: {exc})") from None
    if not model.graph.node:
        raise ModelError(f"{path} is not a readable ONNX model (no graph nodes; truncated or not ONNX?)")
    return model, reads


def _tensors(graph: onnx.GraphProto):
    yield from graph.initializer
    for node in graph.node:
        for a in node.attribute:
            if a.HasField("t"):
                yield a.t
            for sub in ([a.g] if a.HasField("g") else []) + list(a.graphs):
                yield from _tensors(sub)


def refuse_overwriting(target: Path, reads: set[Path]) -> None:
    """The output (and the external data file it may get) must be none of the files the input reads."""
    for candidate in (target, target.with_name(target.name + ".data")):
        if candidate.resolve() in reads or (candidate.exists() and any(
                read.exists() and os.path.samefile(candidate, read) for read in reads)):  # a hard link too
            raise ValueError(f"refusing to write {candidate}: the input model reads that file (the model or its "
                             "external data); choose another output path")
