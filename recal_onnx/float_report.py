"""What computes in float in a converted model: the nodes left between a DequantizeLinear and a QuantizeLinear
(float islands, named in the converter's warning with the module that ran each), and per op type every node
that does float arithmetic, by design or not (``ConversionResult.float_ops``; a ``qdq`` model counted as
onnxruntime runs it, after its own QDQ fusions)."""

from __future__ import annotations

import os
import shutil
import tempfile

import onnx
import onnxruntime as ort

from recal_core.atomic import TEMP_PREFIX

from .ir_edits import EXTERNAL_DATA_BYTES, Graph, Node
from .qdq import activation, sixteen_bits, weight

QDQ_OPS = {"QuantizeLinear", "DequantizeLinear"}
# ops that runtimes (onnxruntime, TensorRT) run quantized when they sit between DQ and Q in a QDQ model
QDQ_FUSIBLE = {"Conv", "Gemm", "MatMul", "Add", "Mul", "Sigmoid", "Relu", "MaxPool", "AveragePool",
               "GlobalAveragePool", "Reshape", "Flatten", "Transpose", "Squeeze", "Unsqueeze", "Concat",
               "Resize", "Split", "Slice"}


SHAPE_READERS = {"Shape", "Size"}  # read a tensor's shape, not its values: what they feed is no float island


NO_ARITHMETIC = SHAPE_READERS | {"Reshape", "Transpose", "Squeeze", "Unsqueeze", "Flatten", "Concat", "Slice", "Gather",
                                 "GatherElements", "GatherND", "Expand", "Identity", "Cast", "Range", "ConstantOfShape",
                                 "Where", "Equal", "And", "Not", "IsNaN", "Split"}


# integer kernels that return float (logits, pre-softmax); MatMulNBits: a weight-only layer, its weights integers
INTEGER_TO_FLOAT = {"MatMulIntegerToFloat", "QGemm", "MatMulNBits"}


def float_compute(model: onnx.ModelProto, qdq: bool = False) -> dict[str, int]:
    """Per op type, the nodes that do arithmetic on float tensors (QDQ and data movement excluded): what runs
    in float in the converted model, whether by design (LayerNorm, Softmax, GELU) or left unconverted. A ``qdq``
    model is counted as onnxruntime runs it (its own QDQ fusions applied): a Conv it fuses with its
    DequantizeLinear inputs and QuantizeLinear output runs in an integer kernel and is not counted."""
    if qdq:
        optimized = _as_onnxruntime_runs(model)
        if optimized is not None:
            return _float_nodes_by_dtype(optimized)
    types = {v.name: v.type.tensor_type.elem_type for v in [*model.graph.value_info, *model.graph.output]}
    floats = {onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16}
    counts: dict[str, int] = {}
    # shape inference types nothing after onnxruntime's contrib ops (MatMulIntegerToFloat, QGemm): there the type
    # is followed from integer sources instead
    untyped = set(_float_nodes_by_dtype(model, names=True))
    for node in model.graph.node:
        if node.op_type in QDQ_OPS or node.op_type in NO_ARITHMETIC or not node.output:
            continue
        known = types.get(node.output[0])
        if (known in floats if known else node.output[0] in untyped) and node.op_type not in INTEGER_TO_FLOAT:
            counts[node.op_type] = counts.get(node.op_type, 0) + 1
    return dict(sorted(counts.items(), key=lambda kv: -kv[1]))


def _as_onnxruntime_runs(model: onnx.ModelProto) -> onnx.ModelProto | None:
    """``model`` after onnxruntime's graph optimizations up to its QDQ fusions (extended level: no layout
    changes), or None when onnxruntime cannot write it (a model over protobuf's limit)."""
    if model.ByteSize() > EXTERNAL_DATA_BYTES:
        return None
    folder = tempfile.mkdtemp(prefix=TEMP_PREFIX + "optimized-")
    try:
        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
        options.optimized_model_filepath = os.path.join(folder, "optimized.onnx")
        options.log_severity_level = 3
        ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
        return onnx.load(options.optimized_model_filepath)
    except Exception:  # noqa: BLE001 - a figure for the report only: fall back to counting the model as written
        return None
    finally:
        shutil.rmtree(folder, ignore_errors=True)


QOPERATOR_KERNELS = {"QGemm", "MatMulInteger", "ConvInteger", "DynamicQuantizeMatMul", "QAttention", "QOrderedMatMul"}
_INTEGER_OPS = INTEGER_TO_FLOAT | QOPERATOR_KERNELS | {"QuantizeLinear", "DynamicQuantizeLinear"}


def qoperator_kernel(op_type: str) -> bool:
    """Whether ``op_type`` is an integer kernel of onnxruntime's QOperator form (every ``QLinear*`` op too)."""
    return op_type.startswith("QLinear") or op_type in QOPERATOR_KERNELS


def _float_nodes_by_dtype(model: onnx.ModelProto, names: bool = False) -> dict[str, int] | list[str]:
    """Per op type, the nodes of an optimized model that compute on float data (with ``names``: their first
    outputs): integer tensors are followed from integer initializers and inputs, shape reads, QuantizeLinear and
    QLinear* ops through data movement (what onnxruntime's optimized model leaves untyped)."""
    integer_types = (onnx.TensorProto.INT8, onnx.TensorProto.UINT8, onnx.TensorProto.INT32, onnx.TensorProto.INT64,
                     onnx.TensorProto.BOOL)
    integer = {i.name for i in model.graph.initializer if i.data_type in integer_types}
    integer |= {i.name for i in model.graph.input if i.type.tensor_type.elem_type in integer_types}
    counts: dict[str, int] = {}
    found = []
    for node in model.graph.node:  # onnxruntime writes its optimized graph in topological order
        data = [i for i in node.input[:1] if i]
        if qoperator_kernel(node.op_type) or node.op_type in _INTEGER_OPS | SHAPE_READERS | {"ArgMax"} or (
                data and all(i in integer for i in data) and node.op_type not in QDQ_OPS) or (
                node.op_type == "Cast" and _casts_to_integer(node)):
            integer.update(o for o in node.output if node.op_type not in INTEGER_TO_FLOAT)
            continue
        if node.op_type in QDQ_OPS or node.op_type in NO_ARITHMETIC:
            continue
        counts[node.op_type] = counts.get(node.op_type, 0) + 1
        found.extend(node.output[:1])
    return found if names else dict(sorted(counts.items(), key=lambda kv: -kv[1]))


def _casts_to_integer(node: onnx.NodeProto) -> bool:
    to = next((a.i for a in node.attribute if a.name == "to"), None)
    return to in (onnx.TensorProto.INT8, onnx.TensorProto.UINT8, onnx.TensorProto.INT32, onnx.TensorProto.INT64,
                  onnx.TensorProto.BOOL)


def module_paths(g: Graph) -> dict[str, str]:
    """`` in module <path>`` for each node the dynamo exporter named anonymously (``node_relu_1``): the module that
    ran it, from the exporter's ``namespace`` metadata (``root: Cls/body.0: Cls/.../relu_1: aten.relu``)."""
    paths = {}
    for node in g.nodes:
        namespace = node.metadata_props.get("namespace") if node.metadata_props else None
        if not namespace or "/" not in namespace:
            continue
        module = namespace.split("/")[-2].split(":")[0].strip()
        if module:
            paths[node.name] = f" in module {module}"
    return paths


def float_islands(g: Graph, expected: set[str]) -> list[Node]:
    """Nodes (not Q/DQ, not ``expected``) on a float path from a dequantized activation to a QuantizeLinear,
    chains of several included (``DQ -> Add -> Relu -> Q`` lists both), in graph order.

    In a QDQ model (``expected`` given) a MatMul / Gemm of a dequantized activation and a dequantized
    constant weight is an integer matmul with a float output (onnxruntime fuses it into
    MatMulIntegerToFloat, as the QOperator form writes it): what follows it starts in float, no island."""
    after_dq: set[Node] = set()  # nodes reached from a dequantized activation, no Q crossed
    stack = [c for node in g.each("DequantizeLinear") if not g.is_const(node.inputs[0])  # per channel too
             for c in g.consumers(node.outputs[0])]
    while stack:
        node = stack.pop()
        if node in after_dq or node.op_type in QDQ_OPS or node.op_type in SHAPE_READERS:
            continue
        after_dq.add(node)
        if expected and node.op_type in ("MatMul", "Gemm") and len(node.inputs) > 1 \
                and activation(g, node.inputs[0]) and weight(g, node.inputs[1]):
            continue
        stack.extend(c for o in node.outputs for c in g.consumers(o))
    before_q: set[Node] = set()  # nodes that reach a QuantizeLinear without crossing a DQ
    stack = [g.producer(node.inputs[0]) for node in g.each("QuantizeLinear")]
    while stack:
        node = stack.pop()
        if node is None or node in before_q or node.op_type in QDQ_OPS:
            continue
        before_q.add(node)
        stack.extend(g.producer(i) for i in node.inputs)
    # (a node reading or writing a 16-bit activation is no QDQ kernel onnxruntime fuses, expected or not)
    return [node for node in g.nodes if node in after_dq and node in before_q and not _no_op_cast(node)
            and (node.op_type not in expected or sixteen_bits(g, node.inputs, node.outputs) is not None)]


def _no_op_cast(node: Node) -> bool:
    """A Cast to the type it reads (float to float) or an Identity: it computes nothing, so it is no float op."""
    if node.op_type == "Identity":
        return True
    if node.op_type != "Cast" or not node.inputs or node.inputs[0] is None or node.inputs[0].type is None:
        return False
    to = node.attributes.get("to")
    return to is not None and int(to.value) == int(node.inputs[0].type.dtype)
