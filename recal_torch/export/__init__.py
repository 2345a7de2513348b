"""ONNX export: a float model as is, a QAT model as QuantizeLinear/DequantizeLinear.

- :mod:`~recal_torch.export.to_onnx`: :func:`export_onnx` and :func:`to_export_model` (the exporters, their checks);
- :mod:`~recal_torch.export.modules`: the export forms of QAT modules (constant quantization parameters);
- :mod:`~recal_torch.export.bias_grid`: each bias put on the int32 grid its int8 layer holds it on.

An internal room: it declares no ``__all__``; what a user imports is :mod:`recal_torch`'s.
"""

from ..errors import ExportError, ExportWarning
from .to_onnx import export_onnx, to_export_model
