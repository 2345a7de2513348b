"""The converter's errors and warnings, one naming scheme: ``*Error`` for what stops a conversion, ``*Warning`` for
what it did and a user should know."""

from __future__ import annotations

# the converted model's outputs differ beyond tolerance (the core's, so that recal's CLI catches it without onnx)
from recal_core.errors import VerificationError as VerificationError


class ModelError(ValueError):
    """The input is not an ONNX model this converter can read, run or convert; the message says why."""


class NonFiniteReferenceError(ValueError):
    """The model being verified against gives no finite value on some output: a defect of that model, not of a
    conversion (nothing can be compared with it)."""

    def __init__(self, outputs: list[str]):
        self.outputs = outputs
        super().__init__(f"the input model's output(s) {', '.join(map(repr, outputs))} are NaN or infinite on every "
                         "verification input")


class UnconvertedOpsWarning(UserWarning):
    """Some ops between a DequantizeLinear and a QuantizeLinear were left in float."""
