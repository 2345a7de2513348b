"""recal_tf: apply a recal recipe to TensorFlow and Keras 3.

Two sibling front ends over shared pieces (``mask_ops``: the per-step pruning tables, computed with the ops of
``tensor_ops``; ``fake_quant``: the quantization grids; ``recipe_support``: what both accept from a recipe):

- :mod:`recal_tf.graph`: the ``tf.compat.v1`` graph API of the seed document, re-exported here so
  ``from recal_tf import ScheduledModifierManager`` works as the seed writes it;
- :mod:`recal_tf.keras`: Keras 3 callbacks and QAT layers, on the TensorFlow, JAX and PyTorch backends.

``recal_tf.models``, ``recal_tf.utils`` and ``recal_tf.input_data`` are the seed's helper modules. All of these
load on first use, so ``recal_tf.keras`` on JAX or PyTorch never imports TensorFlow.
"""

import importlib as _importlib
import os as _os

_os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # keep TensorFlow's C++ start-up chatter out of user output

_MODULES = ("graph", "input_data", "keras", "models", "utils")
_GRAPH_API = (
    "EXTRAS_KEY_LEARNING_RATE", "EXTRAS_KEY_SUMMARIES", "EXTRAS_KEY_UPDATE_OPS", "EXTRAS_KEY_VAR_LIST",
    "EXTRAS_KEY_WEIGHT_DECAY", "EXTRAS_KEY_WEIGHT_DECAY_RATE", "ModifierSessionRunHook", "ScheduledModifierManager",
    "export_onnx",
)
__all__ = [*_GRAPH_API, "RecalWarning", "input_data", "models", "utils"]


def __getattr__(name: str):
    """The seed's names (the graph API) and helper modules, imported when first asked for."""
    if name in _MODULES:
        return _importlib.import_module(f".{name}", __name__)
    if name == "RecalWarning":
        from .recipe_support import RecalWarning

        return RecalWarning
    if name in _GRAPH_API:
        return getattr(_importlib.import_module(".graph", __name__), name)
    raise AttributeError(f"module 'recal_tf' has no attribute {name!r}")


def __dir__():
    return sorted([*globals(), *__all__, "graph", "keras"])
