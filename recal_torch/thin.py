"""Thinning: remove the channels filter or channel pruning left dead, so the model (and its ONNX export,
QDQ or int8) does fewer multiply-adds, not only more zeros.

Which channels are dead is the core's rule (:func:`recal_core.channel_coupling.live_channels`: exactly
zero, or read by no consumer); this module slices the modules. Removing a dead channel from the producers, the
per-channel tensors on the way and the consumers' inputs leaves the outputs as
they were (a test checks it on residual, depthwise and flatten-linear nets, float and QAT).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from recal_core.channel_coupling import input_columns, live_channels
from recal_core.errors import ThinningWarning
from recal_core.head_coupling import Attention, live_heads, unit_rows

from .errors import ThinningError
from .tracing import example_inputs_of, model_graph, trace_args
from .model_params import kernel_axes
from .qat import QATModule, WeightFakeQuantize, WeightOnlyLinear

_BN_TENSORS = ("weight", "bias", "running_mean", "running_var")


@dataclass(frozen=True)
class ThinReport:
    """What :func:`thin` removed: per space, its producers and ``(channels before, after)``; per attention,
    its name and ``(heads before, after)``."""

    spaces: tuple[tuple[tuple[str, ...], int, int], ...]
    heads: tuple[tuple[str, int, int], ...] = ()

    @property
    def removed(self) -> int:
        """Channels and heads removed, in all."""
        return sum(before - after for _, before, after in self.spaces) + sum(b - a for _, b, a in self.heads)

    def __str__(self) -> str:
        rows = [f"{name}: {b} -> {a} heads" for name, b, a in self.heads if a < b]
        rows += [f"{', '.join(p)}: {b} -> {a} channels" for p, b, a in self.spaces if a < b]
        return "\n".join(rows) or "no dead channels"


@torch.no_grad()
def thin(model: nn.Module, example_inputs: Any = None) -> ThinReport:
    """Remove ``model``'s dead channels and attention heads in place (call it after training: the optimizer
    and the manager hold the old tensors). Spaces and attentions the coupling rules cannot thin are left as
    they are. A thinned attention keeps its head size; its module's head counts are updated and its own per-head
    tables (a relative position bias) sliced.

    Where recal has inputs for the model (``example_inputs``, those given to ``modify``, a Hugging Face model's
    own), the thinned model is run on them and must compute what the masked one did: if it does not, the
    channels are thinned alone and each attention's heads one by one, and an attention whose own code splits
    heads by a count recal cannot change (nanoGPT's ``split(n_embd)``) keeps its heads, with a
    :class:`ThinningWarning` saying why; if the channels alone still differ, nothing is removed and a
    :class:`ThinningError` says what went wrong.

    Args:
        model: a trained model whose filter / channel / head pruning left channels or heads exactly zero.
        example_inputs: inputs to trace the model with ``torch.export`` (see
            :meth:`recal_torch.ScheduledModifierManager.modify`); Hugging Face models need none.

    Returns:
        What was removed, per coupled channel space and per attention (its heads)."""
    graph = model_graph(model, example_inputs)
    inputs = trace_args(model, example_inputs) if example_inputs is not None else example_inputs_of(model)
    if inputs is None:
        return _thin(model, graph, with_heads=True)
    was_training = model.training
    model.eval()
    try:
        expected = _run(model, inputs)
        before = _snapshot(model)
        report = _thin(model, graph, with_heads=True)
        problem = _differs(model, inputs, expected)
        if problem is None:
            return report
        _restore(before)
        if report.heads:
            report = _thin(model, graph, with_heads=False)
            if _differs(model, inputs, expected) is None:
                return _heads_one_by_one(model, graph, inputs, expected, report, problem)
            _restore(before)
        raise ThinningError(f"thin: with its dead channels and heads removed, the model {problem}; nothing was "
                            "removed (a module whose code reads a layer's size some other way cannot be thinned)")
    finally:
        model.train(was_training)


def _head_count_values(heads: int, kv_heads: int | None, head_dim: int) -> dict[str, int | None]:
    """The head counts an attention module may keep as attributes, for ``heads`` query heads and ``kv_heads``
    key/value heads (None: unknown, left as they are)."""
    return {"num_attention_heads": heads, "num_heads": heads, "n_heads": heads, "n_head": heads,
            "num_key_value_heads": kv_heads, "num_kv_heads": kv_heads, "all_head_size": heads * head_dim,
            "num_key_value_groups": heads // kv_heads if kv_heads else None}


# the head counts thin and load_thinned set where an attention module has them (split_size: a packed projection's)
HEAD_COUNTS = (*_head_count_values(1, 1, 1), "split_size")


def count_attributes(m: nn.Module, heads: int, kv_heads: int | None, head_dim: int,
                      packed_heads: int | None = None) -> list[tuple[str, int]]:
    """``(attribute, value)`` for the head counts ``m`` keeps as ints that differ from ``heads`` and ``kv_heads``;
    ``split_size`` too where it was ``packed_heads`` heads wide (GPT-2 splits its packed c_attn's output by it)."""
    if kv_heads is not None and (kv_heads <= 0 or heads % kv_heads):
        raise ValueError(f"{heads} query heads do not divide among {kv_heads} key/value heads (grouped-query "
                         "attention gives each key/value head the same number of query heads)")
    values = _head_count_values(heads, kv_heads, head_dim)
    if packed_heads is not None and getattr(m, "split_size", None) == packed_heads * head_dim:
        values["split_size"] = heads * head_dim
    return [(attr, value) for attr, value in values.items()
            if value is not None and isinstance(getattr(m, attr, None), int) and getattr(m, attr) != value]


def _heads_one_by_one(model: nn.Module, graph, inputs, expected, report: ThinReport, problem: str) -> ThinReport:
    """With the channels thinned, each attention's heads removed on their own and kept only where the model still
    computes what it did (T5's cross attentions, when its self attentions share one bias table); a
    :class:`ThinningWarning` names those whose heads stay, with why."""
    modules = dict(model.named_modules())
    heads, stay = [], []
    for att in graph.attentions:
        if att.blockers:
            continue
        before = _snapshot(model)
        thinned = _thin_heads(model, modules, att)
        if thinned is None:
            continue
        why = _differs(model, inputs, expected)
        if why is None:
            heads.append(thinned)
        else:
            _restore(before)
            stay.append((att.name, why))
    if stay:
        names = ", ".join(name for name, _ in stay)
        warnings.warn(f"thin: the heads of {names} stay: with them removed, the model {stay[0][1]} (all at once: "
                      f"{problem}). recal updates an attention's {', '.join(HEAD_COUNTS)} where it has them, and its "
                      "own per-head tables; an attention whose own code splits its heads by another count (its "
                      "input's width, a constant) or shares a per-head table with others cannot be thinned by head "
                      "here; quantize_qat_export (thin=True) removes them from its QAT export, where those counts "
                      "are constants", ThinningWarning, stacklevel=4)
    return ThinReport(report.spaces, tuple(heads))


def _thin(model: nn.Module, graph, with_heads: bool) -> ThinReport:
    modules = dict(model.named_modules())
    done, heads = [], []
    for att in graph.attentions if with_heads else ():
        if not att.blockers:
            thinned = _thin_heads(model, modules, att)
            if thinned is not None:
                heads.append(thinned)
    for space in graph.spaces:
        if not space.thinnable:
            continue
        keep = live_channels(space, _zeros(model, modules))  # the tensors as they are after slicing
        groups = {_group_of(modules[op.name]) for op, _ in space.consumers} - {None}
        if groups and any(modules[op.name].in_features != keep.size for op, _ in space.consumers):
            continue  # group-quantized inputs behind a flatten: whole groups are not whole channels here
        for group in groups:  # a weight-only consumer's scales cover whole groups of inputs: keep groups whole
            keep = _whole_groups(keep, 1, group)
        if keep.all():
            continue
        index = torch.from_numpy(np.flatnonzero(keep))
        for op in space.producers:
            _slice_out(modules[op.name], index)
        for op, _ in space.followers:
            m = modules[op.name]
            if op.kind == "depthwise":
                _slice_out(m, index)
                m.groups = len(index)
                if hasattr(m, "in_channels"):
                    m.in_channels = len(index)
            else:
                for attr in _BN_TENSORS:
                    _slice_attr(m, attr, index, 0)
                m.num_features = len(index)
        for op, _ in space.consumers:
            m = modules[op.name]
            cols = torch.from_numpy(input_columns(index.numpy(), keep.size, _in_width(m)))
            _slice_in(m, cols)
        done.append((tuple(p.name for p in space.producers), keep.size, len(index)))
    return ThinReport(tuple(done), tuple(heads))


def _run(model: nn.Module, inputs: tuple[tuple, dict]) -> list[torch.Tensor]:
    args, kwargs = inputs
    out = model(*args, **kwargs)
    return [t for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.is_floating_point()]


def _differs(model: nn.Module, inputs: tuple[tuple, dict], expected: list[torch.Tensor]) -> str | None:
    """How the model's outputs on ``inputs`` differ from ``expected`` (None: within float rounding)."""
    try:
        got = _run(model, inputs)
    except Exception as exc:  # noqa: BLE001 - any failure of the thinned forward is the finding
        return f"fails on its example inputs ({type(exc).__name__}: {' '.join(str(exc).split())[:200]})"
    if [t.shape for t in got] != [t.shape for t in expected]:
        return f"returns other shapes ({[tuple(t.shape) for t in got]} against {[tuple(t.shape) for t in expected]})"
    for i, (a, b) in enumerate(zip(got, expected)):
        scale = float(b.abs().max()) if b.numel() else 0.0
        diff = float((a - b).abs().max()) if b.numel() else 0.0
        if not diff <= 1e-3 * scale + 1e-6:
            return f"computes other values (output {i} differs by {diff:.3g} of a range of {scale:.3g})"
    return None


def _snapshot(model: nn.Module) -> list[tuple[nn.Module, dict, dict, dict]]:
    """Each module's attributes, parameters and buffers as they are (references, not copies)."""
    return [(m, dict(m.__dict__), dict(m._parameters), dict(m._buffers)) for m in model.modules()]


def _restore(snapshot: list[tuple[nn.Module, dict, dict, dict]]) -> None:
    for m, attrs, params, buffers in snapshot:
        m._parameters.clear()
        m._parameters.update(params)
        m._buffers.clear()
        m._buffers.update(buffers)
        for key in set(m.__dict__) - set(attrs):
            del m.__dict__[key]
        m.__dict__.update({k: v for k, v in attrs.items() if k not in ("_parameters", "_buffers")})


def _zeros(model: nn.Module, modules: dict[str, nn.Module]):
    """``is_zero(name)``: where parameter or buffer ``name`` is exactly zero, in the canonical ``[out, in]`` order
    the core counts in (a transformers Conv1D's weight transposed)."""
    tensors = {**dict(model.named_buffers()), **dict(model.named_parameters())}

    def is_zero(name: str) -> np.ndarray:
        owner, _, attr = name.rpartition(".")
        zero = (tensors[name] == 0).cpu().numpy()
        return zero.T if attr == "weight" and stores_inputs_first(modules[owner]) else zero
    return is_zero


def stores_inputs_first(m: nn.Module) -> bool:
    """A transformers Conv1D (or a QAT or weight-only layer made from one): its weight is ``[in, out]``."""
    return kernel_axes(m, m.weight)[:2] == (1, 0)


def _thin_heads(model: nn.Module, modules: dict[str, nn.Module], att: Attention):
    keep = live_heads(att, _zeros(model, modules))
    output = modules[att.output.rsplit(".", 1)[0]]
    if _group_of(output):  # the output projection's scales cover whole groups of its inputs: keep groups whole
        keep = _whole_groups(keep, att.widths()[att.output], _group_of(output))
    if keep.all():
        return None
    units = np.flatnonzero(keep)
    for weight, width in att.widths().items():
        index = torch.from_numpy(unit_rows(units, width, att.kv_heads))
        layer = modules[weight.rsplit(".", 1)[0]]
        if weight == att.output:
            _slice_in(layer, index)
        else:
            _slice_out(layer, index)
    attention = modules.get(att.name)
    heads = len(units) * att.per_unit
    if attention is not None:  # its own tables with a value per head (Swin's relative position bias)
        query_heads = torch.from_numpy(unit_rows(units, att.per_unit, att.kv_heads))
        projections = {w.rsplit(".", 1)[0] for w in att.widths()}
        for name, table in _per_head_tables(attention, att.name, projections, att.heads):
            owner, _, attr = name.rpartition(".")
            _slice_attr(attention.get_submodule(owner) if owner else attention, attr, query_heads,
                        list(table.shape).index(att.heads))
    for attr, value in count_attributes(attention, heads, len(units), att.head_dim,
                                         att.heads if att.query == att.key else None):
        setattr(attention, attr, value)
    return (att.name, att.heads, heads)


def _per_head_tables(attention: nn.Module, name: str, projections: set[str], heads: int):
    """``(name, parameter)`` of the attention module's own parameters with one axis of ``heads`` entries (and two
    axes or more), outside its projections: a value per head, such as a relative position bias table, which loses
    the removed heads' entries (a wrong guess is caught: ``thin`` runs the model after)."""
    for sub, p in attention.named_parameters():
        owner = f"{name}.{sub}".rsplit(".", 1)[0]
        if p.dim() >= 2 and list(p.shape).count(heads) == 1 and not any(
                owner == q or owner.startswith(q + ".") for q in projections):
            yield sub, p


def _slice_attr(m: nn.Module, attr: str, index: torch.Tensor, dim: int) -> None:
    t = getattr(m, attr, None)
    if t is None:
        return
    new = t.index_select(dim, index).clone()
    if isinstance(t, nn.Parameter):
        setattr(m, attr, nn.Parameter(new, requires_grad=t.requires_grad))
    else:
        setattr(m, attr, new)


def _slice_out(m: nn.Module, index: torch.Tensor) -> None:
    """A conv or linear (float or QAT; a transformers Conv1D) down to the output channels ``index``."""
    _slice_attr(m, "weight", index, 1 if stores_inputs_first(m) else 0)
    _slice_attr(m, "bias", index, 0)
    for attr in ("out_channels", "out_features", "nf"):  # nf: a Conv1D's outputs
        if hasattr(m, attr):
            setattr(m, attr, len(index))
    if isinstance(m, QATModule):
        fq: WeightFakeQuantize = m.weight_fake_quant
        _slice_attr(fq, "scale", index, 0)
        _slice_attr(fq, "zero_point", index, 0)
    if isinstance(m, WeightOnlyLinear):  # its scales: one row per output channel
        _slice_attr(m.weight_fake_quant, "scale", index, 0)


def _in_width(m: nn.Module) -> int:
    return m.in_features if isinstance(m, WeightOnlyLinear) else m.weight.shape[0 if stores_inputs_first(m) else 1]


def _slice_in(m: nn.Module, cols: torch.Tensor) -> None:
    """A conv or linear (float, QAT or weight-only) down to the input columns ``cols``; a weight-only layer in
    groups keeps its groups' scales (``cols`` are whole groups: :func:`_whole_groups`)."""
    _slice_attr(m, "weight", cols, 0 if stores_inputs_first(m) else 1)
    for attr in ("in_channels", "in_features", "nx"):  # nx: a Conv1D's inputs
        if hasattr(m, attr):
            setattr(m, attr, len(cols))
    if isinstance(m, WeightOnlyLinear):
        fq = m.weight_fake_quant
        if fq.per_channel:
            fq.group_size = len(cols)
        else:
            _slice_attr(fq, "scale", torch.unique(cols // fq.group_size), 1)


def _group_of(m: nn.Module) -> int | None:
    """Inputs per scale of a weight-only layer quantized in groups (None: per channel, or not weight-only)."""
    if isinstance(m, WeightOnlyLinear) and not m.weight_fake_quant.per_channel:
        return m.weight_fake_quant.group_size
    return None


def _whole_groups(keep: np.ndarray, width: int, group: int) -> np.ndarray:
    """``keep`` (per unit of ``width`` input columns) widened until the columns kept are whole groups of
    ``group``: a group with one live unit keeps all of its units, so the quantizer's scales still fit."""
    keep = keep.copy()
    while True:
        columns = np.repeat(keep, width).reshape(-1, group).any(1)
        widened = np.repeat(columns, group).reshape(-1, width).any(1) | keep
        if (widened == keep).all():
            return keep
        keep = widened
