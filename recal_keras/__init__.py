"""recal_keras: apply a recal recipe to a Keras 3 model, on its TensorFlow, JAX and PyTorch backends: the same recipe
as recal_torch and the TensorFlow graph API (:mod:`recal_keras.backends` says what each backend runs).

The per-step tables (``mask_ops``, ``qat_tables``, ``lsq``) are written once against a tensor-ops object
(``tensor_ops``: TensorFlow's, or ``keras.ops`` on JAX and PyTorch); ``fake_quant`` holds TensorFlow's quantization
grids. :mod:`recal_tf`'s graph API runs the same tables with TensorFlow's ops.

``model, callbacks = ScheduledModifierManager.from_yaml(recipe).modify(model, optimizer, steps_per_epoch)``,
then ``model.compile(optimizer=optimizer, ...)``, ``model.fit(..., callbacks=callbacks)``,
``manager.finalize(model)`` and :func:`export_onnx`.
"""

from .quiet_start import import_quietly

import_quietly("keras")  # on the TensorFlow backend, without its start-up lines

# imported once Keras is
from . import learned_scales, quantized_layer  # noqa: E402 - registers the QAT layers a saved model is loaded with
from .export import export_onnx  # noqa: E402
from .errors import RecalWarning  # noqa: E402
from .manager import RecalCallback, ScheduledModifierManager  # noqa: E402
from .params import describe_model  # noqa: E402 - recal train's

__all__ = ["RecalCallback", "RecalWarning", "ScheduledModifierManager", "export_onnx"]
