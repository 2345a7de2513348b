"""recal_onnx: turn QAT (QuantizeLinear/DequantizeLinear) ONNX exports into fully quantized int8 models."""

from recal_core.errors import ThinningWarning

from . import cpu
from .convert import quantize_qat_export
from .layer_latency import timed_candidates
from .errors import ModelError, UnconvertedOpsWarning, VerificationError
from .output_diff import task_hits
from .pipeline import read_as_qdq
from .result import ConversionResult
from .save import save_model_atomically
from .sessions import reference_session, session
from .verify import Verification, verify_models
from .verify_inputs import generated_inputs

# ``cpu``: the CPU class a model runs on and what it makes exact (a public module)
__all__ = ["ConversionResult", "ModelError", "ThinningWarning", "UnconvertedOpsWarning", "Verification",
           "VerificationError", "cpu", "generated_inputs", "quantize_qat_export", "read_as_qdq", "reference_session",
           "save_model_atomically", "session", "task_hits", "timed_candidates", "verify_models"]
