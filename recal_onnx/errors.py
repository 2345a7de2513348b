"""The converter's errors and warnings, one naming scheme: ``*Error`` for what stops a conversion, ``*Warning`` for
what it did and a user should know."""

from __future__ import annotations

from recal_core.errors import VerificationFailed


class ModelError(ValueError):
    """The input is not an ONNX model this converter can read, run or convert; the message says why."""


class NonFiniteReferenceError(ValueError):
    """The model being verified against gives no finite value on some output: a defect of that model, not of a
    conversion (nothing can be compared with it)."""

    def __init__(self, outputs: list[str]):
        self.outputs = outputs
        super().__init__(f"the input model's output(s) {', '.join(map(repr, outputs))} are NaN or infinite on every "
                         "verification input")


class VerificationError(VerificationFailed):
    """The converted model's outputs differ from the input model's beyond tolerance."""


class UnconvertedOpsWarning(UserWarning):
    """Some ops between a DequantizeLinear and a QuantizeLinear were left in float."""
