"""recal for Keras 3 on its TensorFlow, JAX and PyTorch backends: the same recipe as recal_torch and the graph API
(:mod:`recal_tf.keras.backends` says what each backend runs).

``model, callbacks = ScheduledModifierManager.from_yaml(recipe).modify(model, optimizer, steps_per_epoch)``,
then ``model.compile(optimizer=optimizer, ...)``, ``model.fit(..., callbacks=callbacks)``,
``manager.finalize(model)`` and :func:`export_onnx`.
"""

from ..quiet_start import import_quietly

import_quietly("keras")  # on the TensorFlow backend, without its start-up lines

# imported once Keras is
from . import learned_scales  # noqa: E402 - registers the learned-scale layers QAT layers are built with
from .export import export_onnx  # noqa: E402
from .manager import RecalCallback, RecalWarning, ScheduledModifierManager  # noqa: E402
from .params import describe_model  # noqa: E402 - recal train's

__all__ = ["RecalCallback", "RecalWarning", "ScheduledModifierManager", "export_onnx"]
