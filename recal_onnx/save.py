"""Writing converted models: atomically, and a model with its twin as one transaction."""

from __future__ import annotations

import os
from pathlib import Path

import onnx

from recal_core.atomic import atomic_folder

from .ir_edits import EXTERNAL_DATA_BYTES
from .twin import twin_path

EXTERNAL_TENSOR_BYTES = 1024  # tensors of at least this size go to the external data file of a large model


def save_model_atomically(model: onnx.ModelProto, output_path: str | os.PathLike) -> Path:
    """Write ``model`` to ``output_path`` atomically; above ~1.8 GB its tensors go to ``<name>.data``.

    Args:
        model: the ONNX model.
        output_path: the file to write (its folder must exist); nothing partial is ever left there."""
    return save_models_atomically(model, output_path)[0]


def save_models_atomically(model: onnx.ModelProto, output_path: str | os.PathLike,
                           twin: onnx.ModelProto | None = None) -> tuple[Path, Path | None]:
    """Write ``model`` (and ``twin`` beside it, :func:`~recal_onnx.twin.twin_path`) as one transaction: every file
    is written in a temporary folder first and moved in only when all are written, so a failure leaves every
    earlier file (a user's own included) as it was, and nothing this run did not create is ever removed."""
    target = Path(output_path)
    pair = [(model, target)] + ([(twin, twin_path(target))] if twin is not None else [])
    with atomic_folder(target.parent) as folder:
        for proto, path in pair:
            large = proto.ByteSize() > EXTERNAL_DATA_BYTES if proto.ByteSize() >= 0 else True
            onnx.save_model(proto, str(folder / path.name), save_as_external_data=large,
                            all_tensors_to_one_file=True, location=path.name + ".data",
                            size_threshold=EXTERNAL_TENSOR_BYTES)
    return target, (pair[1][1] if twin is not None else None)
