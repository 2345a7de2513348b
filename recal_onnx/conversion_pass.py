"""A converter rewrite as an ``onnx_ir`` pass, and a step of them as onnx_ir's ``PassManager``.

Each rewrite in ``recal_onnx.passes`` is a function of the conversion's :class:`~recal_onnx.ir_edits.Graph` (an
``onnx_ir`` model with its constants read once, shared by every pass) that returns how many rewrites it made.
:class:`ConversionPass` runs one as an ``InPlacePass`` on that graph's model, named as its module and function (the
key the conversion's report counts its rewrites under); :func:`run_passes` runs a step of them as a ``PassManager``,
which sweeps them again until a sweep changes nothing where the step repeats. onnx_ir reports a failing pass as a
``PassError`` chained to the cause: the cause is re-raised as it is, so a refusal reaches the user as the
``ModelError`` the pass raised, not as the pass infrastructure's wrapper.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import onnx_ir as ir

from .findings import Findings
from .ir_edits import Graph

Rewrite = Callable[..., int]
MAX_SWEEPS = 1000  # a repeated step that still rewrites after this many sweeps is a converter defect, not a loop


class ConversionPass(ir.passes.InPlacePass):
    """``rewrite(graph, *args[, findings=][, **keywords])`` as an in-place onnx_ir pass on ``graph.model``;
    ``rewrites`` sums what it rewrote over every run."""

    def __init__(self, rewrite: Rewrite, graph: Graph, findings: Findings | None = None, args: tuple = (),
                 keywords: dict | None = None):
        super().__init__()
        self.rewrite, self.graph, self.args = rewrite, graph, args
        self.keywords = dict(keywords or {})
        if findings is not None and takes(rewrite, "findings"):
            self.keywords["findings"] = findings
        self.name = rewrite.__name__
        self.rewrites = 0

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        if model is not self.graph.model:
            raise ir.passes.PassError(f"{self.name} rewrites the model of the graph it was made for, not another")
        count = self.rewrite(self.graph, *self.args, **self.keywords)
        self.rewrites += count
        return ir.passes.PassResult(model, modified=bool(count))

    def __repr__(self) -> str:
        return self.name


def run_passes(passes: Sequence[ConversionPass], repeat: bool = False) -> None:
    """Run ``passes`` in order on their graph's model, once, or (``repeat``) in turn until none rewrites.

    Args:
        passes: the step's passes, all made for the same graph.
        repeat: sweep them again while a sweep rewrites (a QLinear op one pass makes is what the next one matches).
    """
    if not passes:
        return
    manager = ir.passes.PassManager(list(passes), steps=MAX_SWEEPS if repeat else 1, early_stop=True)
    try:
        manager(passes[0].graph.model)
    except ir.passes.PassError as error:
        raise _cause(error) from None


def takes(rewrite: Rewrite, name: str) -> bool:
    """Whether ``rewrite`` takes a parameter called ``name``."""
    return name in rewrite.__code__.co_varnames[:rewrite.__code__.co_argcount + rewrite.__code__.co_kwonlyargcount]


def _cause(error: BaseException) -> BaseException:
    """The first exception under onnx_ir's ``PassError`` wrappers: what the pass itself raised."""
    while isinstance(error, ir.passes.PassError) and error.__cause__ is not None:
        error = error.__cause__
    return error
