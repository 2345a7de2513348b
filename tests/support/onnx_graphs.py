"""Tiny QDQ graphs built with onnx.helper, and running them in onnxruntime."""

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from recal_onnx.passes.uint8_weights import exact_on_this_cpu

OPSET = 17


class Builder:
    def __init__(self, seed: int = 0):
        self.nodes, self.inits = [], []
        self.rng = np.random.default_rng(seed)
        self.n = 0

    def name(self, base):
        self.n += 1
        return f"{base}{self.n}"

    def const(self, value, base="c"):
        name = self.name(base)
        self.inits.append(numpy_helper.from_array(np.asarray(value), name))
        return name

    def node(self, op, inputs, domain=None, **attrs):
        out = self.name(op.lower())
        self.nodes.append(helper.make_node(op, inputs, [out], name=self.name(op), domain=domain, **attrs))
        return out

    def qdq(self, x, scale, zp, dtype=np.uint8):
        s, z = self.const(np.float32(scale)), self.const(np.array(zp, dtype=dtype))
        return self.node("DequantizeLinear", [self.node("QuantizeLinear", [x, s, z]), s, z])

    def weight(self, shape, axis=0, per_channel=True):
        w = self.rng.standard_normal(shape).astype(np.float32) * 0.3
        if per_channel:
            scale = (np.abs(w).reshape(shape[axis], -1) if axis == 0 else np.abs(np.moveaxis(w, axis, 0)).reshape(
                shape[axis], -1)).max(1) / 127
        else:
            scale = np.float32(np.abs(w).max() / 127)
        shape_b = [1] * len(shape)
        if per_channel:
            shape_b[axis] = -1
        q = np.clip(np.round(w / np.reshape(scale, shape_b if per_channel else ())), -127, 127).astype(np.int8)
        zp = np.zeros(np.shape(scale), np.int8)
        attrs = {"axis": axis} if per_channel else {}
        return self.node("DequantizeLinear", [self.const(q, "w"), self.const(np.asarray(scale, np.float32), "ws"),
                                              self.const(zp, "wz")], **attrs)

    def model(self, inputs, outputs):
        graph = helper.make_graph(
            self.nodes, "test",
            [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in inputs],
            [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in outputs], self.inits)
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
        model.ir_version = 8
        return model


def run(model: onnx.ModelProto, feeds, level=None, as_written=False):
    """``model`` in onnxruntime: int8 weights through their exact uint8 twin where this CPU saturates them,
    unless ``as_written``."""
    model = model if as_written else exact_on_this_cpu(model)
    options = ort.SessionOptions()
    if level is not None:
        options.graph_optimization_level = level
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"]).run(None, feeds)


def reference(model, feeds):
    """The QDQ model simulated in float (no fusion): the numbers every rewrite must keep."""
    return run(model, feeds, level=ort.GraphOptimizationLevel.ORT_DISABLE_ALL)


def ops(model):
    return [n.op_type for n in model.graph.node]


def with_float_biases(src, dst, shift=1e-3):
    """A copy of the QDQ model at ``src`` whose Conv / Gemm biases are moved by ``shift``: biases between the int32
    steps an int8 layer holds, as exporters other than ``recal_torch``'s write them (its are on the grid, and
    its conversions exact); returns ``dst``."""
    model = onnx.load(str(src))
    biases = {n.input[2] for n in model.graph.node if n.op_type in ("Conv", "Gemm") and len(n.input) > 2}
    for t in model.graph.initializer:
        if t.name in biases:
            t.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(t) + np.float32(shift), t.name))
    onnx.save(model, str(dst))
    return dst


def biases_and_steps(model):
    """Per Conv / Gemm / MatMul + Add of an exported QDQ model, in graph order: its float bias and the int32 step
    it is held in, input scale x weight scale (both read through the layout ops exporters put in between)."""
    values = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    values.update({n.output[0]: numpy_helper.to_array(n.attribute[0].t) for n in model.graph.node
                   if n.op_type == "Constant"})
    producer = {o: n for n in model.graph.node for o in n.output}
    consumers = {}
    for n in model.graph.node:
        for i in n.input:
            consumers.setdefault(i, []).append(n)

    def dq(name):
        node = producer[name]
        while node.op_type in ("Pad", "MaxPool", "Relu", "Flatten", "Reshape", "Transpose", "Identity"):
            node = producer[node.input[0]]
        assert node.op_type == "DequantizeLinear", node.op_type
        return node

    def added(name):  # the constant an Add after ``name`` (through a Reshape) adds, else None
        users = consumers.get(name, [])
        while len(users) == 1 and users[0].op_type == "Reshape":
            name = users[0].output[0]
            users = consumers.get(name, [])
        if len(users) == 1 and users[0].op_type == "Add":
            other = next(i for i in users[0].input if i != name)
            return other if other in values else None
        return None

    found = []
    for node in model.graph.node:
        if node.op_type in ("Conv", "Gemm") and len(node.input) > 2:
            bias = node.input[2]
        elif node.op_type in ("Conv", "MatMul") and added(node.output[0]):
            bias = added(node.output[0])
        else:
            continue
        x, w = dq(node.input[0]), dq(node.input[1])
        step = values[x.input[1]].astype(np.float64) * values[w.input[1]].astype(np.float64)
        found.append((values[bias].astype(np.float64).reshape(-1), step))
    return found


def assert_biases_on_grid(model, layers):
    """Assert that each of the ``layers`` Conv / Gemm / MatMul + Add biases of ``model`` is a whole number of its
    int32 steps (to float32's rounding of ``k * s_x * s_w``); return them as ``biases_and_steps`` does."""
    found = biases_and_steps(model)
    assert len(found) == layers, len(found)
    for bias, step in found:
        k = bias / step
        assert np.all(np.abs(k - np.round(k)) <= 1e-3 * np.maximum(1, np.abs(k))), k
    return found


QONNX_DOMAIN = "qonnx.custom_op.general"


def qonnx_reference(model: onnx.ModelProto, feeds: dict) -> list:
    """``model`` with QONNX ``Quant`` nodes run by onnx's reference evaluator, ``Quant`` written here from QONNX's
    specification (scale, add the zero point, clip to the bit width's range, round by the node's mode, undo), in
    float32: what the QONNX file means, independent of the converter's reading of it."""
    from onnx.reference import ReferenceEvaluator
    from onnx.reference.op_run import OpRun

    rounding = {"ROUND": np.round, "CEIL": np.ceil, "FLOOR": np.floor, "DOWN": np.trunc,
                "UP": lambda v: np.where(v < 0, np.floor(v), np.ceil(v)),
                "HALF_UP": lambda v: np.where(v < 0, np.ceil(v - 0.5), np.floor(v + 0.5)),
                "HALF_DOWN": lambda v: np.where(v < 0, np.floor(v + 0.5), np.ceil(v - 0.5))}

    class Quant(OpRun):
        op_domain = QONNX_DOMAIN

        def _run(self, x, scale, zeropt, bitwidth, signed=1, narrow=0, rounding_mode="ROUND"):
            bits = int(np.asarray(bitwidth).reshape(-1)[0])  # QONNX's one bit width, of any shape
            lo = (-(2 ** (bits - 1)) + narrow) if signed else 0
            hi = (2 ** (bits - 1) - 1) if signed else (2 ** bits - 1 - narrow)
            mode = rounding_mode.decode() if isinstance(rounding_mode, bytes) else rounding_mode
            y = np.clip(x / scale + zeropt, lo, hi).astype(np.float32)
            return (((rounding[mode.upper()](y) - zeropt) * scale).astype(np.float32),)

    return ReferenceEvaluator(model, new_ops=[Quant]).run(None, feeds)


def _aimet_entries(entries: dict) -> dict[str, tuple[np.ndarray, np.ndarray, int]]:
    """AIMET's encodings (0.6.1 or 1.0.0 layout) as ``{tensor: (scales, offsets, bits)}``, integer encodings only."""
    found = {}
    for section in ("activation_encodings", "param_encodings"):
        value = entries.get(section) or {}
        items = value.items() if isinstance(value, dict) else ((e["name"], e) for e in value)
        for name, e in items:
            if isinstance(e, list):  # 0.6.1: one dict a channel
                if str(e[0].get("dtype", "int")).lower() == "int":
                    found[name] = (np.array([c["scale"] for c in e], np.float32),
                                   np.array([c["offset"] for c in e], np.float32), int(e[0]["bitwidth"]))
            elif str(e.get("dtype", "INT")).upper() == "INT":
                found[name] = (np.array(e["scale"], np.float32), np.array(e["offset"], np.float32), int(e["bw"]))
    return found


def aimet_reference(model: onnx.ModelProto, entries: dict, feeds: dict) -> list:
    """``model`` as AIMET's simulation computes it with ``entries``: every encoded tensor replaced by
    ``(clip(round(x / scale) - offset, 0, 2**bw - 1) + offset) * scale`` (a weight per channel along axis 0, as a
    Conv's), run by onnx's reference evaluator in float32; independent of the converter's reading and its judge."""
    from onnx.reference import ReferenceEvaluator

    def simulate(x, scales, offsets, bits, axis=0):
        shape = [1] * x.ndim
        if scales.size > 1:
            shape[axis] = -1
        s, o = scales.reshape(shape), offsets.reshape(shape)
        return ((np.clip(np.round(x / s) - o, 0, 2 ** bits - 1) + o) * s).astype(np.float32)

    encoded = _aimet_entries(entries)
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    for init in copy.graph.initializer:
        if init.name in encoded:
            init.CopyFrom(numpy_helper.from_array(simulate(numpy_helper.to_array(init), *encoded[init.name]), init.name))
    feeds = {k: simulate(v, *encoded[k]) if k in encoded else v for k, v in feeds.items()}
    outputs = [o.name for o in copy.graph.output]
    inner = [n for n in encoded if n not in feeds and n not in {t.name for t in copy.graph.initializer}]
    evaluator = ReferenceEvaluator(copy)
    values = dict(zip(outputs, evaluator.run(outputs, feeds)))
    if any(n not in outputs for n in inner):
        raise NotImplementedError("an encoded tensor inside the graph: this reference simulates inputs, weights and "
                                  "outputs only")
    return [simulate(values[n], *encoded[n]) if n in encoded else values[n] for n in outputs]


def qonnx_quant(b: "Builder", x: str, scale, zero_point, bits, **attrs) -> str:
    """A QONNX ``Quant`` of ``x`` (narrow, signed and rounding_mode as given) in ``b``."""
    inputs = [x, b.const(np.asarray(scale, np.float32)), b.const(np.asarray(zero_point, np.float32)),
              b.const(np.float32(bits))]
    return b.node("Quant", inputs, domain=QONNX_DOMAIN, **{"narrow": 0, **attrs})


def qonnx_model(b: "Builder", inputs, outputs) -> onnx.ModelProto:
    """``b``'s graph with QONNX's domain; ``outputs`` as (name, shape): shape inference cannot see past a Quant."""
    model = b.model(inputs, [name for name, _ in outputs])
    for value, (_, shape) in zip(model.graph.output, outputs):
        value.CopyFrom(helper.make_tensor_value_info(value.name, TensorProto.FLOAT, shape))
    model.opset_import.append(helper.make_opsetid(QONNX_DOMAIN, 1))
    return model


def aimet_layer(legacy=False, **changes):
    """A float Conv + Relu (the graph output) and AIMET's encodings of it: the input (asymmetric, 8 bits), the
    weight per channel (symmetric), the output; ``changes`` edits the weight's entry (1.0.0 layout) or, with
    ``legacy``, the 0.6.1 layout of the same numbers."""
    b = Builder()
    w = b.const(np.random.default_rng(0).standard_normal((4, 3, 3, 3)).astype(np.float32) * 0.3, "w")
    y = b.node("Relu", [b.node("Conv", ["x", w], pads=[1, 1, 1, 1])])
    model = b.model([("x", [2, 3, 6, 6])], [y])
    w_scales = [0.004, 0.005, 0.0045, 0.006]
    entries = {"activation_encodings": [
        {"name": "x", "bw": 8, "dtype": "INT", "enc_type": "PER_TENSOR", "is_sym": False, "offset": [-120],
         "scale": [0.03]},
        {"name": y, "bw": 8, "dtype": "INT", "enc_type": "PER_TENSOR", "is_sym": False, "offset": [0],
         "scale": [0.02]}],
        "param_encodings": [{"name": w, "bw": 8, "dtype": "INT", "enc_type": "PER_CHANNEL", "is_sym": True,
                             "offset": [-128] * 4, "scale": w_scales, **changes}], "version": "1.0.0"}
    if legacy:
        entries = {"version": "0.6.1", **{section: {e["name"]: [
            {"bitwidth": e["bw"], "dtype": e["dtype"].lower(), "is_symmetric": str(e["is_sym"]), "offset": o,
             "scale": sc, "min": 0.0, "max": 1.0} for o, sc in zip(e["offset"], e["scale"])]
            for e in entries[section]} for section in ("activation_encodings", "param_encodings")}}
    return model, entries, w
