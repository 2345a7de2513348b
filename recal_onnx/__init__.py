"""recal_onnx: turn QAT (QuantizeLinear/DequantizeLinear) ONNX exports into fully quantized int8 models."""

from recal_core.errors import ThinningWarning

from .convert import quantize_qat_export
from .errors import ModelError, UnconvertedOpsWarning, VerificationError
from .result import ConversionResult
from .save import save_model_atomically
from .verify import Verification, verify_models

__all__ = ["ConversionResult", "ModelError", "ThinningWarning", "UnconvertedOpsWarning", "Verification",
           "VerificationError", "quantize_qat_export", "save_model_atomically", "verify_models"]
