"""recal_tf: apply a recal recipe to a TensorFlow (``tf.compat.v1`` graph mode) training graph.

The API of the seed document: ``ScheduledModifierManager.from_yaml``, ``create_ops``,
``initialize_session``, ``complete_graph`` and the ``EXTRAS_KEY_*`` names.
"""

import os as _os

_os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # keep TensorFlow's C++ start-up chatter out of user output

from . import input_data, models, utils  # noqa: E402
from .manager import (  # noqa: E402
    EXTRAS_KEY_LEARNING_RATE,
    EXTRAS_KEY_SUMMARIES,
    EXTRAS_KEY_UPDATE_OPS,
    EXTRAS_KEY_VAR_LIST,
    EXTRAS_KEY_WEIGHT_DECAY,
    EXTRAS_KEY_WEIGHT_DECAY_RATE,
    ModifierSessionRunHook,
    RecalWarning,
    ScheduledModifierManager,
)

__all__ = [
    "EXTRAS_KEY_LEARNING_RATE", "EXTRAS_KEY_SUMMARIES", "EXTRAS_KEY_UPDATE_OPS", "EXTRAS_KEY_VAR_LIST",
    "EXTRAS_KEY_WEIGHT_DECAY",
    "EXTRAS_KEY_WEIGHT_DECAY_RATE", "ModifierSessionRunHook", "RecalWarning", "ScheduledModifierManager",
    "input_data", "models", "utils",
]
