"""recal_torch's errors and warnings, one naming scheme: ``*Error`` for what stops (nothing is changed), ``*Warning``
for what was done another way than asked and why."""

from __future__ import annotations


class ExportWarning(UserWarning):
    """The exporter asked for could not export the model; the other one did (the message says why)."""


class ExportError(RuntimeError):
    """Neither of torch's exporters wrote a model that runs; the message gives both reasons."""


class ThinningError(ValueError):
    """The thinned model would not compute what the masked one did: nothing was removed."""


class QATPlanWarning(UserWarning):
    """The QAT planner could not read the model's forward: the layers it names are quantized less than they could
    be (the message says what stays float)."""

# --- preparing a model ---------------------------------------------------------------------
