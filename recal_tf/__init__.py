"""recal_tf: apply a recal recipe to a TensorFlow graph (``tf.compat.v1``), as the seed document writes it.

- :mod:`recal_tf.graph`: the graph API (``ScheduledModifierManager``, ``ModifierSessionRunHook``, the
  ``EXTRAS_KEY_*`` names, :func:`export_onnx`), re-exported here so ``from recal_tf import
  ScheduledModifierManager`` works as the seed writes it;
- ``recal_tf.models``, ``recal_tf.utils`` and ``recal_tf.input_data``: the seed's helper modules.

The graph API runs the per-step tables and quantization grids of :mod:`recal_keras` with TensorFlow's ops, the
ones Keras runs on its TensorFlow backend. Keras 3 models (on TensorFlow, JAX or PyTorch) are :mod:`recal_keras`'s;
``recal_tf.keras`` still names it.
"""

import os as _os

_os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # keep TensorFlow's C++ start-up chatter out of user output

from recal_keras import RecalWarning  # after the log level: importing it imports TensorFlow

from . import graph
from .graph import *  # noqa: F403 - the seed's graph API, as the seed imports it: from recal_tf import ...

__all__ = [*graph.__all__, "RecalWarning"]
