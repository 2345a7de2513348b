"""recal_tf: apply a recal recipe to TensorFlow.

Two sibling front ends over shared TensorFlow pieces (``fake_quant``: the quantization grids; ``mask_ops``: the
per-step pruning tables; ``recipe_support``: what a TensorFlow front end accepts from a recipe):

- :mod:`recal_tf.graph`: the ``tf.compat.v1`` graph API of the seed document, re-exported here so
  ``from recal_tf import ScheduledModifierManager`` works as the seed writes it;
- :mod:`recal_tf.keras`: Keras 3 callbacks and QAT layers.

``recal_tf.models``, ``recal_tf.utils`` and ``recal_tf.input_data`` are the seed's helper modules.
"""

import os as _os

_os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # keep TensorFlow's C++ start-up chatter out of user output

from . import input_data, models, utils  # noqa: E402
from . import graph  # noqa: E402
from .graph import *  # noqa: E402,F401,F403 - the seed's API, as the seed imports it
from .recipe_support import RecalWarning  # noqa: E402

__all__ = [*graph.__all__, "RecalWarning", "input_data", "models", "utils"]
