"""The ``tf.compat.v1`` graph API of the seed document: ``ScheduledModifierManager.from_yaml``, ``create_ops``,
``initialize_session``, ``complete_graph``, the ``EXTRAS_KEY_*`` names and :func:`export_onnx`.

:mod:`recal_tf` re-exports all of it, so the seed's ``from recal_tf import ScheduledModifierManager`` works.
"""

from recal_keras.quiet_start import import_quietly

import_quietly("tensorflow")  # without its start-up lines

# frozen_graph_def, graph_def_to_onnx and describe_variables: for recal train (imported once TensorFlow is)
from .export import export_onnx, frozen_graph_def, graph_def_to_onnx  # noqa: E402
from .manager import (  # noqa: E402
    EXTRAS_KEY_LEARNING_RATE,
    EXTRAS_KEY_SUMMARIES,
    EXTRAS_KEY_UPDATE_OPS,
    EXTRAS_KEY_VAR_LIST,
    EXTRAS_KEY_WEIGHT_DECAY,
    EXTRAS_KEY_WEIGHT_DECAY_RATE,
    ModifierSessionRunHook,
    ScheduledModifierManager,
)
from .params import describe_variables  # noqa: E402

__all__ = [
    "EXTRAS_KEY_LEARNING_RATE", "EXTRAS_KEY_SUMMARIES", "EXTRAS_KEY_UPDATE_OPS", "EXTRAS_KEY_VAR_LIST",
    "EXTRAS_KEY_WEIGHT_DECAY", "EXTRAS_KEY_WEIGHT_DECAY_RATE", "ModifierSessionRunHook", "ScheduledModifierManager",
    "export_onnx",
]
