"""recal for Keras 3 (``tf.keras`` on TensorFlow 2.16+): the same recipe as recal_torch and the graph API.

``model, callbacks = ScheduledModifierManager.from_yaml(recipe).modify(model, optimizer, steps_per_epoch)``,
then ``model.compile(optimizer=optimizer, ...)``, ``model.fit(..., callbacks=callbacks)``,
``manager.finalize(model)`` and :func:`export_onnx`.
"""

from .export import export_onnx
from .manager import RecalCallback, RecalWarning, ScheduledModifierManager

__all__ = ["RecalCallback", "RecalWarning", "ScheduledModifierManager", "export_onnx"]
