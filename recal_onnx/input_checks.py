"""What the converter refuses before any work, and how it names a QAT model that is itself broken: opsets,
foreign ops (NNCF's OpenVINO export among them, with the way to QDQ), quantized types with no kernel, blocked
quantization, non-finite scales; and, when verification finds outputs that are never finite, the model's
non-finite initializers."""

from __future__ import annotations

import numpy as np
import onnx

from .errors import ModelError
from .float_report import QDQ_OPS


# onnxruntime runs the default domain's opsets in this range (QuantizeLinear needs 10, per-channel 13)
MIN_OPSET = 10
KNOWN_DOMAINS = {"", "ai.onnx", "com.microsoft", "ai.onnx.ml"}


WEIGHTED = ("Conv", "ConvTranspose", "Gemm", "MatMul")  # layers whose constant weight an integer kernel holds


def check_input(model: onnx.ModelProto, name: str, encodings: bool = False) -> None:
    """What the converter cannot take, said before any work: opsets, foreign ops, not a QAT model (a float one with
    ``encodings`` beside it is one)."""
    opsets = {o.domain or "": o.version for o in model.opset_import}
    version = opsets.get("", opsets.get("ai.onnx"))
    newest = onnx.defs.onnx_opset_version()
    if version is None or not MIN_OPSET <= version <= newest:
        raise ModelError(f"{name} uses opset {version} of the default ONNX domain; the converter takes "
                         f"opsets {MIN_OPSET} to {newest} (QuantizeLinear needs 10, per-channel weights 13)")
    foreign = sorted({(n.domain, n.op_type) for n in model.graph.node
                      if n.domain not in KNOWN_DOMAINS and not is_qonnx_quantizer(n.op_type, n.domain)})
    if foreign:
        listed = ", ".join(f"{op} ({domain})" for domain, op in foreign[:5])
        hint = ("; NNCF writes OpenVINO's FakeQuantize by default: for QuantizeLinear/DequantizeLinear, strip the "
                "model (nncf.strip(model, example_input=x)) and export it with torch.onnx.export"
                if any(op == "FakeQuantize" for _, op in foreign) else "")
        if any(op in QONNX_OPS and is_qonnx_domain(domain) for domain, op in foreign):
            hint = ("; this is QONNX, whose integer Quant the converter reads, but not its Trunc (Brevitas' "
                    "TruncAvgPool), BipolarQuant (1 bit) or FloatQuant (minifloat), which have no integer kernel in "
                    "onnxruntime: quantize those layers to integers of 2 to 8 bits, or export with "
                    "brevitas.export.export_onnx_qcdq")
        raise ModelError(f"{name} has ops of custom domains, which onnxruntime cannot run: {listed}{hint}")
    quantized = any(n.op_type in QDQ_OPS or is_qonnx_quantizer(n.op_type, n.domain) for n in model.graph.node)
    if encodings and quantized:
        raise ModelError(f"{name} is already quantized (QuantizeLinear / DequantizeLinear or QONNX nodes); AIMET's "
                         "encodings go with the float model its QuantizationSimModel.export writes beside them")
    if not quantized and not encodings:
        raise ModelError(f"{name} is not a QAT model: it has no QuantizeLinear/DequantizeLinear nodes (a float model "
                         "from AIMET's QuantizationSimModel.export converts with its encodings: encodings=...)")
    for output in model.graph.output:
        if output.type.WhichOneof("value") not in ("tensor_type", None):
            raise ModelError(f"{name}: output {output.name!r} is a {output.type.WhichOneof('value')[:-5]}, not a "
                             "tensor; the converter and its verification take tensor outputs")
    constants = _constants(model)
    _check_quantized_types(model, name, constants)
    _check_blocks(model, name, constants)
    _check_clamp_bounds(model, name, constants)
    _check_empty_weights(model, name, constants)


def _check_empty_weights(model: onnx.ModelProto, name: str, constants: dict[str, onnx.TensorProto]) -> None:
    """A layer whose weight has no values (shape [0, 3, 3, 3], float or dequantized) computes nothing the integer
    kernels agree on, and a dequantized constant with no values quantizes nothing: refused, naming node and shape."""
    empty = {key: list(t.dims) for key, t in constants.items() if 0 in t.dims}
    if not empty:
        return
    for node in model.graph.node:
        if node.op_type == "DequantizeLinear" and node.input and node.input[0] in empty:
            empty[node.output[0]] = empty[node.input[0]]
    for node in model.graph.node:
        read = next((i for i in node.input[:1 if node.op_type == "DequantizeLinear" else None] if i in empty), None)
        if read is not None and (node.op_type in WEIGHTED or node.op_type == "DequantizeLinear"):
            raise ModelError(f"{name}: {node.op_type} {node.name!r} reads {read!r}, a constant of shape {empty[read]} "
                             "that holds no values: a zero-size layer computes nothing; remove it from the model "
                             "before converting")


def _constants(model: onnx.ModelProto) -> dict[str, onnx.TensorProto]:
    """Every constant tensor by name: initializers and ``Constant`` nodes' values."""
    found = {t.name: t for t in model.graph.initializer}
    for node in model.graph.node:
        if node.op_type == "Constant" and node.output:
            value = next((a.t for a in node.attribute if a.name == "value" and a.type == onnx.AttributeProto.TENSOR),
                         None)
            if value is not None:
                found[node.output[0]] = value
    return found


def _check_clamp_bounds(model: onnx.ModelProto, name: str, constants: dict[str, onnx.TensorProto]) -> None:
    """A NaN bound of ``Max``, ``Min`` or ``Clip`` makes its output NaN (or the bound meaningless): refused, named."""
    for node in model.graph.node:
        if node.op_type not in ("Max", "Min", "Clip"):
            continue
        for value in node.input:
            tensor = constants.get(value)
            if tensor is not None and tensor.data_type in FLOAT_TYPES and _has_nan(tensor):
                raise ModelError(f"{name}: {node.op_type} {node.name or node.output[0]!r} has a NaN bound (constant "
                                 f"{value!r}): its output is NaN or unbounded, a broken export")


FLOAT_TYPES = {onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.DOUBLE}
# the integer types the converter writes kernels for: uint8 / int8 tensors, int32 biases behind a DequantizeLinear
QUANTIZED_TYPES = {onnx.TensorProto.UINT8, onnx.TensorProto.INT8}
BIAS_TYPES = {onnx.TensorProto.INT32}
QONNX_OPS = {"Quant", "BipolarQuant", "Trunc", "IntQuant", "FloatQuant"}  # QONNX's quantizers (qonnx.custom_op.general)
QONNX_QUANTIZERS = ("Quant", "IntQuant")  # its integer quantizer (renamed IntQuant): read as QCDQ (qonnx_to_qcdq)

ACTIVATION_16_TYPES = {onnx.TensorProto.UINT16, onnx.TensorProto.INT16}
WEIGHT_TYPES = {onnx.TensorProto.INT4, onnx.TensorProto.UINT4}  # constant weights only: widened to 8 bits


def is_qonnx_domain(domain: str) -> bool:
    """QONNX's ops' domain, as its writers name it (qonnx.custom_op.general, finn.custom_op.general, onnx.brevitas)."""
    return any(name in domain for name in ("qonnx", "finn", "brevitas"))


def is_qonnx_quantizer(op_type: str, domain: str) -> bool:
    return op_type in QONNX_QUANTIZERS and is_qonnx_domain(domain)


def _check_blocks(model: onnx.ModelProto, name: str, tensors: dict[str, onnx.TensorProto]) -> None:
    """A weight quantized in blocks has one scale a block along its axis: said by node, with the axis the scale
    does fit where there is one (an exporter that wrote the wrong axis), before onnxruntime refuses it in its words."""
    for node in model.graph.node:
        block = _int_attr(node, "block_size", 0)
        weight, scale = (tensors.get(v) for v in (list(node.input) + ["", ""])[:2])
        if node.op_type != "DequantizeLinear" or block <= 0 or weight is None or scale is None:
            continue
        shape, got = list(weight.dims), list(scale.dims)
        axis = _int_attr(node, "axis", 1) % max(len(shape), 1)

        def blocks(along: int) -> list[int]:
            return [-(-d // block) if i == along else d for i, d in enumerate(shape)]

        if len(got) != len(shape) or got == blocks(axis):
            continue
        fits = [a for a in range(len(shape)) if a != axis and got == blocks(a)]
        reader = next((n for n in model.graph.node if node.output[0] in n.input), None)
        transposed = reader is not None and reader.op_type == "Gemm" and _int_attr(reader, "transB", 0)
        hint = (f"; that scale gives blocks along axis {fits[0]}"
                + (f", the K axis of the Gemm (transB=1) {reader.name!r} that reads it" if transposed else "")
                + f": the exporter wrote axis {axis} where it meant {fits[0]} (NVIDIA ModelOpt's ONNX INT4 "
                "quantizer does so for a Gemm's weight); set that axis, or leave the layer out of the quantization "
                "(ModelOpt: nodes_to_exclude), and convert again" if fits else "")
        raise ModelError(f"{name}: DequantizeLinear {node.name or node.output[0]!r} has a scale of shape {got} for "
                         f"its {shape} weight {weight.name!r} in blocks of {block} along axis {axis}, which needs "
                         f"{blocks(axis)}{hint}")


def _int_attr(node: onnx.NodeProto, attribute: str, default: int) -> int:
    """``node``'s integer attribute, ``default`` where it has none."""
    return next((a.i for a in node.attribute if a.name == attribute), default)


def _check_quantized_types(model: onnx.ModelProto, name: str, tensors: dict[str, onnx.TensorProto]) -> None:
    """Every quantized tensor is uint8 / int8 (an int32 bias too; a constant weight may be 4-bit, and quantized in
    blocks; an activation may be 16-bit where others are 8-bit: mixed precision, its layers left float), refused at
    the start otherwise: 16-bit weights, 4-bit activations or float8 tensors have no QLinear kernels here, and a model
    written with them would be invalid; a model whose every activation is 16-bit would convert nothing.
    ``tensors``: the model's constants (initializers and ``Constant`` nodes alike)."""
    types = {value: t.data_type for value, t in tensors.items()}
    wide, narrow = [], 0  # activation quantizers on 16 bits, on 8
    # a weight's own quantizer: a QuantizeLinear of a constant (AIMET writes float weights so), and the DQ after it
    weight_q = {n.output[0] for n in model.graph.node
                if n.op_type == "QuantizeLinear" and n.input and n.input[0] in tensors and n.output}
    for node in model.graph.node:
        if node.op_type not in QDQ_OPS or not node.input:  # a node without inputs: the checker names it later
            continue
        blocked = _int_attr(node, "block_size", 0)
        constant_weight = node.input[0] in tensors or (node.op_type == "DequantizeLinear"
                                                       and node.input[0] in weight_q)
        if blocked and not constant_weight:
            raise ModelError(f"{name}: {node.op_type} {node.name or node.output[0]!r} quantizes an activation in "
                             f"blocks of {blocked} (opset 21 block_size), which no integer kernel reads; quantize "
                             "activations per tensor")
        scale = tensors.get(node.input[1]) if len(node.input) > 1 else None
        if scale is not None and scale.data_type == onnx.TensorProto.FLOAT and not _finite(scale):
            readers = _quantized_for(model, tensors)
            exclude = f"nodes_to_exclude={readers!r}" if readers else "nodes_to_exclude"
            raise ModelError(f"{name}: {node.op_type} {node.name or node.output[0]!r} has a scale that is NaN or "
                             f"infinite (initializer {scale.name!r}): the QAT model's integers there mean nothing (a "
                             "diverged training, a broken export, or a calibration of a tensor holding -inf, such as a "
                             "causal mask's attention scores: leave that tensor unquantized, with quantize_static's "
                             f"{exclude})")
        if scale is not None and scale.data_type in (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16,
                                                     onnx.TensorProto.DOUBLE):
            try:
                values = onnx.numpy_helper.to_array(scale)
            except Exception:  # noqa: BLE001 - a malformed tensor: the checker names it later
                values = np.ones(1)
            activation = node.op_type == "QuantizeLinear" and node.input[0] not in tensors
            if activation and np.any(values <= 0):  # a weight's may be negative (onnxruntime's blocked int4 are)
                bad = values[values <= 0].ravel()[:4].tolist()
                raise ModelError(f"{name}: {node.op_type} {node.name or node.output[0]!r} has a scale of {bad} "
                                 f"(initializer {scale.name!r}); a scale is positive (an activation's divides it): the "
                                 "QAT model's integers there mean nothing (a learned scale that left its range, or a "
                                 "broken export)")
        zero_point = node.input[2] if len(node.input) > 2 and node.input[2] else ""
        dtype = types.get(zero_point)
        if dtype is None and node.op_type == "DequantizeLinear":
            dtype = types.get(node.input[0])
        if dtype is None:
            attr = _int_attr(node, "output_dtype", 0)
            dtype = attr or (onnx.TensorProto.UINT8 if node.op_type == "QuantizeLinear" else None)
        if dtype in QUANTIZED_TYPES and not constant_weight:
            narrow += 1
        if dtype is None or dtype in QUANTIZED_TYPES or (node.op_type == "DequantizeLinear" and dtype in BIAS_TYPES):
            continue
        if constant_weight and dtype in WEIGHT_TYPES:
            continue  # 4-bit weights are 8-bit integers to the kernels (recal_onnx.passes.widen_weights)
        if not constant_weight and dtype in ACTIVATION_16_TYPES:
            wide.append((node, dtype))  # its layers stay float, named; refused below if every activation is so
            continue
        verb = "quantizes tensor {!r} to" if node.op_type == "QuantizeLinear" else "dequantizes tensor {!r} from"
        raise ModelError(f"{name}: {node.op_type} {node.name!r} {verb.format(node.input[0])} "
                         f"{_type_name(dtype)}; the converter writes uint8 / int8 "
                         "tensors (int32 biases): re-export with 8-bit quantization")
    if wide and not narrow:
        node, dtype = wide[0]
        raise ModelError(f"{name}: every activation is quantized to 16 bits ({_type_name(dtype)}, first at "
                         f"{node.op_type} {node.name or node.output[0]!r}; {len(wide)} such nodes), and onnxruntime's "
                         "integer kernels read 8-bit activations, so no layer would run on integers: re-export with "
                         "8-bit activations (a model with some 16-bit tensors among 8-bit ones converts, the layers "
                         "on the 16-bit tensors left float and named)")


def _quantized_for(model: onnx.ModelProto, tensors: dict[str, onnx.TensorProto]) -> list[str]:
    """The names of the nodes that read, dequantized, a tensor quantized with a scale that is not finite: what a
    quantizer quantized it for (all of them at once, so one re-quantization leaves them all out)."""
    broken = {q.output[0] for q in model.graph.node if q.op_type == "QuantizeLinear" and len(q.input) > 1
              and q.input[1] in tensors and tensors[q.input[1]].data_type == onnx.TensorProto.FLOAT
              and not _finite(tensors[q.input[1]]) and q.output}
    dequantized = {n.output[0] for n in model.graph.node if n.op_type == "DequantizeLinear" and n.input
                   and n.input[0] in broken and n.output}
    return sorted({n.name or n.output[0] for n in model.graph.node if dequantized & set(n.input)})


def nonfinite_initializers(reference: onnx.ModelProto | str, listed: int = 5) -> str:
    """``" (non-finite initializers: a, b)"``: the QAT model's float constants holding NaN or inf, '' if none."""
    model = onnx.load(reference, load_external_data=False) if isinstance(reference, str) else reference
    bad = []
    for tensor in model.graph.initializer:
        if tensor.data_type in FLOAT_TYPES and not _finite(tensor):
            bad.append(tensor.name)
    if not bad:
        return " (every float initializer is finite: an op overflows or divides by zero)"
    more = f" and {len(bad) - listed} more" if len(bad) > listed else ""
    return f" (non-finite initializers: {', '.join(map(repr, bad[:listed]))}{more})"


def _type_name(dtype: int) -> str:
    """An ONNX element type's name (``int16``), or its number where the file holds none ONNX defines."""
    try:
        return onnx.TensorProto.DataType.Name(dtype).lower()
    except ValueError:
        return f"element type {dtype} (not one ONNX defines)"


def _values(tensor: onnx.TensorProto) -> np.ndarray | None:
    """A constant's values, or None where they are stored outside the file or malformed (the checks that read it
    say what is wrong)."""
    if tensor.data_location == onnx.TensorProto.EXTERNAL:
        return None
    try:
        return onnx.numpy_helper.to_array(tensor)
    except (ValueError, TypeError):
        return None


def _has_nan(tensor: onnx.TensorProto) -> bool:
    values = _values(tensor)
    return values is not None and bool(np.isnan(values).any())


def _finite(tensor: onnx.TensorProto) -> bool:
    """Whether a float initializer holds no NaN or inf (one stored outside the file, or malformed, counts as
    finite)."""
    values = _values(tensor)
    return values is None or bool(np.isfinite(values).all())
    try:
        return bool(np.isfinite(onnx.numpy_helper.to_array(tensor)).all())
    except (ValueError, TypeError):
        return True
