"""Describe a Keras 3 model's variables to the core: name, layer and whether it is a conv / dense kernel.

A variable's name is its Keras ``path`` without the model's own name (``c1/kernel``, ``block/c2/kernel``),
the same ``/``-separated form the graph API uses, so a recipe's ``params`` read alike in both.
"""

from __future__ import annotations

import keras

from recal_core.params import ParamInfo

# Keras stores conv kernels as [*spatial, in, out] and Dense kernels as [in, out]; the core's canonical
# order is [out, in, *spatial]. Depthwise and transposed convs are left without a layout (unstructured only).
_CONV_TYPES = (keras.layers.Conv1D, keras.layers.Conv2D, keras.layers.Conv3D)
_TRANSPOSED = (keras.layers.Conv1DTranspose, keras.layers.Conv2DTranspose, keras.layers.Conv3DTranspose)


def _kernel_axes(layer, kernel) -> tuple[int, ...] | None:
    rank = len(kernel.shape)
    if isinstance(layer, _TRANSPOSED):
        return None
    if isinstance(layer, _CONV_TYPES):
        return (rank - 1, rank - 2, *range(rank - 2))
    if isinstance(layer, keras.layers.Dense):
        return (1, 0)
    return None


def kernels(model: keras.Model) -> dict[int, tuple[keras.layers.Layer, tuple[int, ...] | None]]:
    """``id(variable)`` -> (its layer, canonical axes) for every conv / dense kernel in ``model``."""
    out = {}
    for layer in model._flatten_layers(include_self=False, recursive=True):
        for attr in ("kernel", "depthwise_kernel", "pointwise_kernel"):
            var = getattr(layer, attr, None) if layer.built else None
            if isinstance(var, keras.Variable):
                out[id(var)] = (layer, _kernel_axes(layer, var) if attr != "depthwise_kernel" else None)
    return out


def variable_name(model: keras.Model, variable: keras.Variable) -> str:
    prefix = f"{model.name}/"
    return variable.path[len(prefix):] if variable.path.startswith(prefix) else variable.path


def describe_model(model: keras.Model) -> tuple[list[ParamInfo], dict[str, keras.Variable]]:
    """The core's view of ``model``'s trainable and non-trainable weights, and name -> variable."""
    found = kernels(model)
    infos, by_name = [], {}
    for variable in model.weights:
        name = variable_name(model, variable)
        if name in by_name:  # a variable shared by two layers is listed once
            continue
        kernel = found.get(id(variable))
        shape = tuple(int(d) for d in variable.shape)
        infos.append(ParamInfo(name, name.rpartition("/")[0], kernel is not None, shape,
                               kernel[1] if kernel else None))
        by_name[name] = variable
    return infos, by_name
