"""Initializers a file also lists as graph inputs are constants only, as the converter reads them."""

from __future__ import annotations

from ..findings import Findings
from ..ir_edits import Graph


def inputs_to_constants(g: Graph, findings: Findings) -> int:
    """Initializers the file also lists as graph inputs (torch.onnx's ``keep_initializers_as_inputs``, as Brevitas
    exports): the converter reads them as the constants they hold (weights fold into integers), so the converted
    model holds them as constants, not as inputs a caller could feed (onnxruntime warns of each at every load)."""
    listed = [value for value in g.graph.inputs if value.is_initializer()]
    for value in listed:
        g.graph.inputs.remove(value)
    if listed:
        findings.notes.append(f"{len(listed)} initializers the file also listed as graph inputs are constants of the "
                              "converted model, as the converter read them (their weights are now its integers)")
    return len(listed)
