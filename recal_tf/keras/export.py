"""Export a Keras 3 model to ONNX (Keras's own ``model.export(format="onnx")``, which runs tf2onnx), atomically."""

from __future__ import annotations

import contextlib
import os
import warnings

import keras

from recal_core.atomic import atomic_path


def export_onnx(model: keras.Model, path: str | os.PathLike, *, opset: int | None = None) -> str:
    """Write ``model`` as ONNX to ``path`` (nothing is written unless the whole export and the ONNX checker
    succeed, and the ONNX model takes the Keras model's inputs only); returns the path. The model must have been
    called once (``fit``, ``predict`` or ``model(x)``).

    Args:
        model: a Keras model; after a QuantizationModifier, the model ``modify`` returned (a QDQ export).
        path: the ``.onnx`` file to write.
        opset: the ONNX opset (tf2onnx's default when None)."""
    import onnx

    try:
        import tf2onnx  # noqa: F401 - Keras's ONNX export needs it
    except ImportError as exc:
        raise ImportError("exporting Keras to ONNX needs tf2onnx>=1.17: pip install 'recal[tf-cpu]'") from exc
    with atomic_path(path) as tmp, warnings.catch_warnings(), _normalization_constants_in_graph(model):
        warnings.filterwarnings("ignore", category=FutureWarning)  # Keras's tf2onnx shim probes np.object
        kwargs = {} if opset is None else {"opset_version": opset}
        model.export(str(tmp), format="onnx", verbose=False, **kwargs)
        onnx.checker.check_model(str(tmp))
        inputs = [i.name for i in onnx.load(str(tmp), load_external_data=False).graph.input]
        if len(inputs) != len(model.inputs):
            raise ValueError(f"exporting {model.name!r} to ONNX: the export takes {len(inputs)} inputs where the "
                             f"model takes {len(model.inputs)} ({', '.join(inputs)}): a layer computes with "
                             "constants it holds outside its weights, which Keras's ONNX export writes as graph "
                             "inputs; nothing was written")
    return str(path)


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


def _all_layers(model):
    """Every layer of ``model``, those of nested models included."""
    for layer in model.layers:
        yield layer
        if isinstance(layer, keras.Model):
            yield from _all_layers(layer)
