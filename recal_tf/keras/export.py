"""Export a Keras 3 model to ONNX (Keras's own ``model.export(format="onnx")``, which runs tf2onnx), atomically."""

from __future__ import annotations

import os
import warnings

import keras

from recal_core.atomic import atomic_path


def export_onnx(model: keras.Model, path: str | os.PathLike, *, opset: int | None = None) -> str:
    """Write ``model`` as ONNX to ``path`` (nothing is written unless the whole export and the ONNX checker
    succeed); returns the path. The model must have been called once (``fit``, ``predict`` or ``model(x)``).

    Args:
        model: a Keras model; after a QuantizationModifier, the model ``modify`` returned (a QDQ export).
        path: the ``.onnx`` file to write.
        opset: the ONNX opset (tf2onnx's default when None)."""
    import onnx

    try:
        import tf2onnx  # noqa: F401 - Keras's ONNX export needs it
    except ImportError as exc:
        raise ImportError("exporting Keras to ONNX needs tf2onnx>=1.17: pip install 'recal[tf-cpu]'") from exc
    with atomic_path(path) as tmp, warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=FutureWarning)  # Keras's tf2onnx shim probes np.object
        kwargs = {} if opset is None else {"opset_version": opset}
        model.export(str(tmp), format="onnx", verbose=False, **kwargs)
        onnx.checker.check_model(str(tmp))
    return str(path)
