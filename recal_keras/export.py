"""Export a Keras 3 model to ONNX with Keras's own ``model.export(format="onnx")``, atomically: tf2onnx on the
TensorFlow backend, jax2onnx on JAX's, ``torch.onnx`` on PyTorch's.

A QAT model's export from JAX or PyTorch is laid out by onnxruntime's basic graph optimizations (constant folding,
transposes cancelled, no-op casts removed): those exporters write each op of Keras's channels-last layout between
Transposes and the constants a layer computes from its variables as ops, where tf2onnx's own optimizer leaves the
``Q -> DQ -> Conv -> Add -> Relu -> Q`` chains the int8 converter reads.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import warnings

import keras
import numpy as np

from recal_core.atomic import atomic_path

_EXPORTERS = {  # backend -> (the module Keras's ONNX export needs there, how to install it)
    "tensorflow": ("tf2onnx", "'recal[tf-cpu]' (tf2onnx>=1.17)"),
    "jax": ("jax2onnx", "jax2onnx"),
    "torch": ("onnxscript", "onnxscript"),
}


def export_onnx(model: keras.Model, path: str | os.PathLike, *, opset: int | None = None) -> str:
    """Write ``model`` as ONNX to ``path`` (nothing is written unless the whole export and the ONNX checker
    succeed, and the ONNX model takes the Keras model's inputs only); returns the path. A model never called is
    called once on zeros of its input shapes first (Keras's own export refuses it on the JAX and PyTorch backends).

    Args:
        model: a Keras model; after a QuantizationModifier, the model ``modify`` returned (a QDQ export).
        path: the ``.onnx`` file to write.
        opset: the ONNX opset (tf2onnx's default when None)."""
    import onnx

    backend = keras.backend.backend()
    module, extra = _EXPORTERS[backend]
    try:
        importlib.import_module(module)  # what Keras's ONNX export runs on this backend
    except ImportError as exc:
        raise ImportError(f"exporting Keras to ONNX on the {backend} backend needs {module}: "
                          f"pip install {extra}") from exc
    if backend in ("jax", "torch") and not getattr(model, "_called", True):
        # JAX's fit and predict run the model statelessly, which Keras's export does not count; on PyTorch's a
        # model built from Input layers (keras.applications) and never called is refused by Keras's export
        _call_once(model)
    with atomic_path(path) as tmp, warnings.catch_warnings(), _normalization_constants_in_graph(model):
        warnings.filterwarnings("ignore", category=FutureWarning)  # Keras's tf2onnx shim probes np.object
        if backend == "torch":  # Keras's own ops convert tensors to Python numbers as torch.jit traces them (some
            # 900 warnings for a MobileNetV2): the written model is run against the Keras model below instead
            import torch

            warnings.filterwarnings("ignore", category=torch.jit.TracerWarning)
        kwargs = {} if opset is None else {"opset_version": opset}
        try:
            model.export(str(tmp), format="onnx", verbose=False, **kwargs)
            _external_data_inline(str(tmp))
        finally:  # a failed export's side file too
            with contextlib.suppress(FileNotFoundError):
                os.remove(str(tmp) + ".data")
        if backend == "jax":
            _pools_channels_first(str(tmp))
        if backend != "tensorflow" and _holds_qat(model):
            _laid_out_for_int8(str(tmp))
        onnx.checker.check_model(str(tmp))
        inputs = [i.name for i in onnx.load(str(tmp), load_external_data=False).graph.input]
        if len(inputs) != len(model.inputs):
            raise ValueError(f"exporting {model.name!r} to ONNX: the export takes {len(inputs)} inputs where the "
                             f"model takes {len(model.inputs)} ({', '.join(inputs)}): a layer computes with "
                             "constants it holds outside its weights, which Keras's ONNX export writes as graph "
                             "inputs; nothing was written")
        _check_runs(str(tmp), model, backend)
    return str(path)


def _external_data_inline(path: str) -> None:
    """An exporter that wrote the weights beside the model (jax2onnx: ``<path>.data``, a name of the temporary
    file's) has them put back in the model file and its side file removed: the ``.onnx`` written is one file that
    reads no hidden neighbour (the caller removes the side file; a model over protobuf's 2 GB is refused)."""
    import onnx

    if not os.path.exists(path + ".data"):
        return
    model = onnx.load(path)  # with the external data
    if model.ByteSize() >= 2**31:
        raise ValueError(f"the ONNX export is {model.ByteSize() / 2**30:.1f} GiB, over the 2 GiB a single .onnx "
                         "file holds; export a smaller model (nothing was written)")
    onnx.save(model, path)


@contextlib.contextmanager
def _normalization_constants_in_graph(model: keras.Model):
    """A ``Normalization`` layer keeps its mean and variance as eager tensors, which Keras's ONNX export (tf2onnx)
    writes as graph inputs nobody feeds (keras.applications' EfficientNets); as arrays during the export they
    become constants of the graph, the values the layer computes with."""
    swapped = []
    for layer in _all_layers(model):
        if isinstance(layer, keras.layers.Normalization):
            for name in ("mean", "variance"):
                value = getattr(layer, name, None)
                if value is not None and hasattr(value, "numpy") and not isinstance(value, keras.Variable):
                    swapped.append((layer, name, value))
                    object.__setattr__(layer, name, value.numpy())
    try:
        yield
    finally:
        for layer, name, value in swapped:
            object.__setattr__(layer, name, value)


def _pools_channels_first(path: str) -> None:
    """jax2onnx writes a channels-last 2-D pool over a rank-6 tensor (``[1, 1, N, H, W, C]``, window ``[1, k, k, 1]``),
    a four-dimensional op onnxruntime has no kernel for (a ``MaxPool`` / ``AveragePool``), or, for Keras's average
    pool (a window sum divided by the window's size), a ``Conv`` with an all-ones kernel, a ``Squeeze`` and a ``Div``
    that no int8 pass reads as a pool. Each becomes the 2-D pool of ``[N, C, H, W]`` between Squeeze / Transpose
    and Transpose (/ Unsqueeze), which computes the same values, so the file is the model Keras computes."""
    import onnx
    from onnx import helper, numpy_helper

    model = onnx.load(path)
    constants = {i.name: i for i in model.graph.initializer}
    readers: dict[str, list] = {}
    for node in model.graph.node:
        for name in node.input:
            readers.setdefault(name, []).append(node)
    nodes, dropped, changed = [], set(), False
    for node in model.graph.node:
        if node.output[0] in dropped:
            continue
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        pool = _six_axis_pool(node, attrs) or _window_sum_average(node, attrs, constants, readers)
        if pool is None:
            nodes.append(node)
            continue
        op, window, strides, x_in, y_out, replaced = pool
        dropped.update(n.output[0] for n in replaced)
        if not changed:
            model.graph.initializer.append(numpy_helper.from_array(np.array([0, 1], np.int64), "recal_pool_axes"))
        changed = True
        x = f"{node.name}_recal"
        window_sum = node.op_type == "Conv"  # a Conv's attributes are not a pool's; the Div's output is [N, H, W, C]
        spatial = {"kernel_shape": window, "strides": strides}
        if not window_sum:  # a pool's own attributes (ceil_mode, count_include_pad...) stay
            spatial.update({k: v for k, v in attrs.items() if k not in ("kernel_shape", "strides", "pads")})
        pooled = [helper.make_node("Squeeze", [x_in, "recal_pool_axes"], [f"{x}_nhwc"], name=f"{x}_squeeze"),
                  helper.make_node("Transpose", [f"{x}_nhwc"], [f"{x}_nchw"], name=f"{x}_nchw", perm=[0, 3, 1, 2]),
                  helper.make_node(op, [f"{x}_nchw"], [f"{x}_pooled"], name=node.name, **spatial)]
        if window_sum:
            pooled.append(helper.make_node("Transpose", [f"{x}_pooled"], [y_out], name=f"{x}_nhwc", perm=[0, 2, 3, 1]))
        else:
            pooled += [
                helper.make_node("Transpose", [f"{x}_pooled"], [f"{x}_out"], name=f"{x}_nhwc", perm=[0, 2, 3, 1]),
                helper.make_node("Unsqueeze", [f"{x}_out", "recal_pool_axes"], [y_out], name=f"{x}_unsqueeze")]
        nodes += pooled
    if changed:
        del model.graph.node[:]
        model.graph.node.extend(nodes)
        onnx.save(model, path)


def _six_axis_pool(node, attrs: dict):
    """``(op, window, strides, input, output, nodes replaced)`` of a rank-6 ``MaxPool`` / ``AveragePool``."""
    kernel = list(attrs.get("kernel_shape", []))
    if node.op_type not in ("MaxPool", "AveragePool") or len(kernel) != 4 or kernel[0] != 1 or kernel[-1] != 1 \
            or any(p != 0 for p in attrs.get("pads", [])):
        return None
    return node.op_type, kernel[1:3], list(attrs.get("strides", [1] * 4))[1:3], node.input[0], node.output[0], [node]


def _window_sum_average(node, attrs: dict, constants: dict, readers: dict):
    """The same for jax2onnx's average pool: ``Conv(x6, ones[1, 1, 1, kh, kw, 1]) -> Squeeze([0, 1]) -> Div(kh * kw)``
    without padding."""
    from onnx import numpy_helper

    if node.op_type != "Conv" or len(node.input) != 2 or node.input[1] not in constants or attrs.get("group", 1) != 1 \
            or any(p != 0 for p in attrs.get("pads", [])) or any(d != 1 for d in attrs.get("dilations", [])):
        return None
    kernel = numpy_helper.to_array(constants[node.input[1]])
    if kernel.ndim != 6 or kernel.shape[:3] != (1, 1, 1) or kernel.shape[5] != 1 or not np.all(kernel == 1):
        return None
    squeeze = readers.get(node.output[0], [])
    divide = readers.get(squeeze[0].output[0], []) if len(squeeze) == 1 and squeeze[0].op_type == "Squeeze" else []
    if len(divide) != 1 or divide[0].op_type != "Div" or divide[0].input[0] != squeeze[0].output[0] \
            or divide[0].input[1] not in constants:
        return None
    axes = constants.get(squeeze[0].input[1]) if len(squeeze[0].input) > 1 else None
    size = numpy_helper.to_array(constants[divide[0].input[1]])
    window = [int(kernel.shape[3]), int(kernel.shape[4])]
    if axes is None or sorted(numpy_helper.to_array(axes).tolist()) != [0, 1] or size.size != 1 \
            or float(size.reshape(-1)[0]) != window[0] * window[1]:
        return None
    strides = list(attrs.get("strides", [1] * 4))
    if len(strides) != 4 or strides[0] != 1 or strides[3] != 1:
        return None
    return "AveragePool", window, strides[1:3], node.input[0], divide[0].output[0], [node, squeeze[0], divide[0]]


def _holds_qat(model: keras.Model) -> bool:
    from .qat import QuantizedMerge
    from .quantized_layer import QuantizedLayer

    return any(isinstance(layer, (QuantizedLayer, QuantizedMerge)) for layer in _all_layers(model))


# onnxruntime's basic-level MatMul + Add fusion writes a Gemm whose bias is a dequantized int32 tensor, a form the
# int8 converter does not read; MatMul and Add apart it turns into an integer dense layer
_KEPT_APART = ["MatMulAddFusion"]


def _laid_out_for_int8(path: str) -> None:
    """Rewrite the QDQ model at ``path`` with onnxruntime's basic (ONNX-only, provider-independent) optimizations."""
    try:
        import onnxruntime
    except ImportError as exc:
        raise ImportError("exporting a QAT model from Keras's JAX or PyTorch backend lays the ONNX graph out with "
                          "onnxruntime: pip install onnxruntime") from exc
    options = onnxruntime.SessionOptions()
    options.graph_optimization_level = onnxruntime.GraphOptimizationLevel.ORT_ENABLE_BASIC
    options.optimized_model_filepath = path + ".basic"
    try:
        onnxruntime.InferenceSession(path, options, providers=["CPUExecutionProvider"],
                                     disabled_optimizers=_KEPT_APART)
        os.replace(path + ".basic", path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.remove(path + ".basic")


def _check_runs(path: str, model: keras.Model, backend: str) -> None:
    """Refuse an export onnxruntime cannot run (a default session, on a batch of zeros), naming what it said."""
    try:
        import onnxruntime
    except ImportError:  # nothing to check with; the ONNX checker passed
        return
    try:
        session = onnxruntime.InferenceSession(path, providers=["CPUExecutionProvider"])
        zeros = {i.name: np.zeros([d if isinstance(d, int) else 1 for d in i.shape], _NUMPY.get(i.type, np.float32))
                 for i in session.get_inputs()}
        session.run(None, zeros)
    except Exception as exc:  # noqa: BLE001 - onnxruntime's errors share no base class
        said = str(exc).strip().splitlines()[0][:300]
        raise ValueError(f"exporting {model.name!r} to ONNX on the {backend} backend: onnxruntime cannot run the "
                         f"export ({said}); nothing was written") from None


_NUMPY = {"tensor(float)": np.float32, "tensor(double)": np.float64, "tensor(int64)": np.int64,
          "tensor(int32)": np.int32, "tensor(uint8)": np.uint8, "tensor(int8)": np.int8, "tensor(bool)": np.bool_}


def _call_once(model: keras.Model) -> None:
    """Call ``model`` on zeros of its input shapes (a batch of one)."""
    inputs = [np.zeros([1 if d is None else d for d in i.shape], i.dtype) for i in model.inputs]
    model(inputs if len(inputs) > 1 else inputs[0])


def _all_layers(model):
    """Every layer of ``model``, those of nested models included."""
    for layer in model.layers:
        yield layer
        if isinstance(layer, keras.Model):
            yield from _all_layers(layer)
