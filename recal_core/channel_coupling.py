"""Which channels must be pruned together, and which tensors follow them: the rules filter and channel
pruning and thinning share, for every backend.

A backend describes its model as a list of :class:`Op` (one per layer or op of its traced graph); this
module groups the tensors into *channel spaces*: tensors whose channel ``c`` is the same channel. Ops
that keep channels (BatchNorm, ReLU, pooling, a depthwise conv) put their output in their input's space;
a residual ``+`` merges the spaces it adds; a conv or linear layer starts a new space (its *producer*).
In a space:

- the *producers* are the layers whose output rows are its channels (several when a residual add merges
  them: they prune the same filters);
- the *followers* are per-channel tensors of the ops on the way (a BatchNorm's shift and running mean, a
  depthwise conv's filter and bias, a producer's bias), zeroed with a pruned channel so it is exactly zero;
- the *consumers* are the layers that read it (their input channels; after a flatten, ``spatial``
  consecutive features per channel).

A space is *thinnable* when nothing else touches it: no model input or output, no concat, reshape,
attention or op this module does not know. Filter pruning needs a thinnable space whose producers are all
pruned by the same modifier (one ranking for the group); channel pruning the same of its consumers. What
does not hold is a :class:`CouplingError` naming the layer and what blocks it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Literal

import numpy as np
from .errors import CouplingError

OpKind = Literal["layer", "depthwise", "norm", "same", "add", "flatten", "input", "output", "other"]
"""``layer``: a conv or linear (weight ``[out, in, ...]``); ``depthwise``: a conv with one filter per
channel; ``norm``: a per-channel affine normalisation; ``same``: channel-wise and zero-preserving (ReLU,
pooling, dropout, identity); ``add``: an elementwise sum; ``flatten``: ``[N, C, *spatial] -> [N, C * S]``;
``input`` / ``output``: the model's; ``other``: anything else (the spaces it touches are not thinnable)."""


@dataclass(frozen=True)
class Op:
    """One op of a traced model, as the coupling rules see it."""

    name: str  # the layer's or op's name in the model (for messages)
    kind: OpKind
    inputs: tuple[str, ...]  # tensor ids
    output: str | None = None
    weight: str | None = None  # parameter names (layer, depthwise, norm)
    bias: str | None = None
    channel_tensors: tuple[str, ...] = ()  # further per-channel tensors zeroed with a pruned channel


@dataclass
class Space:
    """Tensors sharing channels, with who makes them, what follows them and who reads them."""

    producers: list[Op] = field(default_factory=list)
    followers: list[tuple[Op, tuple[str, ...]]] = field(default_factory=list)  # (op, tensors zeroed)
    consumers: list[tuple[Op, int]] = field(default_factory=list)  # (layer, features per channel)
    blockers: list[str] = field(default_factory=list)  # why it is not thinnable
    tensors: list[str] = field(default_factory=list)  # the op outputs in it (channels on axis 1)

    @property
    def thinnable(self) -> bool:
        return not self.blockers and bool(self.producers)


@dataclass
class ModelGraph:
    """What a backend traced of a model: its channel spaces and its attentions
    (:class:`recal_core.head_coupling.Attention`)."""

    spaces: list[Space]
    attentions: list = field(default_factory=list)


class _Union:
    def __init__(self) -> None:
        self.parent: dict[str, str] = {}

    def find(self, x: str) -> str:
        self.parent.setdefault(x, x)
        while self.parent[x] != x:
            self.parent[x] = self.parent[self.parent[x]]
            x = self.parent[x]
        return x

    def join(self, a: str, b: str) -> None:
        self.parent[self.find(a)] = self.find(b)


def channel_spaces(ops: list[Op]) -> list[Space]:
    """The channel spaces of a model, in the order their first tensor appears."""
    union = _Union()
    flattened: dict[str, tuple[str, Op]] = {}  # flatten output -> (its input tensor, the flatten op)
    for op in ops:
        if op.output is not None:
            union.find(op.output)
        if op.kind == "same" and op.inputs and op.inputs[0] in flattened and op.output is not None:
            flattened[op.output] = flattened[op.inputs[0]]  # (de)quantizing a flattened tensor keeps its layout
        elif op.kind in ("depthwise", "norm", "same", "add") and op.output is not None:
            for t in op.inputs:
                union.join(t, op.output)
        if op.kind == "flatten" and op.output is not None and op.inputs:
            flattened[op.output] = (op.inputs[0], op)
    spaces: dict[str, Space] = {}

    def space(tensor: str) -> Space:
        return spaces.setdefault(union.find(tensor), Space())

    for op in ops:
        if op.kind == "layer":
            if op.output is not None:
                space(op.output).producers.append(op)
            for t in op.inputs[:1]:
                if t in flattened:  # a linear after a flatten reads spatial features per channel
                    source, flat = flattened[t]
                    space(source).consumers.append((op, -1))
                    if any(o is not op and t in o.inputs for o in ops):
                        space(source).blockers.append(f"the output of {flat.name} is read by more than {op.name}")
                else:
                    space(t).consumers.append((op, 1))
        elif op.kind in ("depthwise", "norm"):
            space(op.inputs[0]).followers.append((op, tuple(n for n in (op.weight if op.kind == "depthwise" else None,
                                                                        op.bias, *op.channel_tensors) if n)))
        elif op.kind == "input":
            if op.output is not None:
                space(op.output).blockers.append("the model's input")
        elif op.kind == "output":
            for t in op.inputs:
                if t in flattened:
                    t = flattened[t][0]
                space(t).blockers.append("the model's output")
        elif op.kind == "flatten" and op.inputs and op.inputs[0] in flattened:
            space(flattened[op.inputs[0]][0]).blockers.append(f"{op.name} (a second flatten)")
        elif op.kind in ("depthwise", "norm", "add") and any(t in flattened for t in op.inputs):
            for t in op.inputs:
                if t in flattened:
                    space(flattened[t][0]).blockers.append(f"{op.name} (reads a flattened tensor)")
        elif op.kind == "other":
            for t in op.inputs:
                space(flattened[t][0] if t in flattened else t).blockers.append(op.name)
            if op.output is not None:
                space(op.output).blockers.append(op.name)
    for tensor in union.parent:
        if union.find(tensor) in spaces and tensor not in flattened:
            spaces[union.find(tensor)].tensors.append(tensor)
    return list(spaces.values())


def pruning_groups(spaces: list[Space], pruned: dict[str, tuple[int, str]]) -> list[tuple[Space, str, list[Op]]]:
    """For the weights pruned ``filter`` or ``channel`` (``pruned[weight] = (modifier index, kind)``, by
    parameter name): one group per space, ``(space, kind, the layers ranked together)``. A
    :class:`CouplingError` where a space cannot be pruned as one: a producer (filter) or consumer
    (channel) left out, two modifiers sharing it, or a blocker.
    """
    groups: dict[int, tuple[Space, str, list[Op]]] = {}
    for weight, (modifier, kind) in pruned.items():
        found = [(s, op) for s in spaces for op in (s.producers if kind == "filter" else [c for c, _ in s.consumers])
                 if op.weight == weight]
        what = "output channels (filters)" if kind == "filter" else "input channels"
        if not found:
            raise CouplingError(f"{weight}: mask_type {kind}: recal cannot trace where its {what} go", modifier)
        space, op = found[0]
        if space.blockers:
            raise CouplingError(f"{op.name}: mask_type {kind}: its {what} also reach {space.blockers[0]}, which "
                                "cannot drop channels; use an unstructured or block mask_type for this layer, "
                                "or leave it out of params", modifier)
        members = list(space.producers) if kind == "filter" else [c for c, _ in space.consumers]
        for other in members:
            if pruned.get(other.weight) != (modifier, kind):
                role = "adds its output to" if kind == "filter" else "reads the same channels as"
                raise CouplingError(
                    f"{op.name}: mask_type {kind}: {other.name} {role} {op.name} and must prune the same channels: "
                    f"give it the same modifier and mask_type (layers pruned together: "
                    f"{', '.join(m.name for m in members)})", modifier)
        groups[id(space)] = (space, kind, members)
    return list(groups.values())


def channel_pruned(layouts: dict[str, dict[int, object]]) -> dict[str, tuple[int, str]]:
    """The parameters a plan prunes ``filter``, ``channel`` or ``head`` (``{param: {modifier: layout}}``, as
    :class:`recal_core.model_plan.MaskPlan` holds them): ``{param: (modifier index, kind)}``."""
    return {name: (index, layout.mask_type) for name, per in layouts.items() for index, layout in per.items()
            if getattr(layout, "mask_type", None) in ("filter", "channel", "head")}


def followers_of(space: Space) -> list[str]:
    """The per-channel tensors zeroed with a pruned filter of ``space``: producers' biases, then the
    followers' tensors, each once."""
    names = [p.bias for p in space.producers if p.bias] + [t for _, ts in space.followers for t in ts]
    return list(dict.fromkeys(names))


def live_channels(space: Space, is_zero: Callable[[str], np.ndarray]) -> np.ndarray:
    """Which channels of a thinnable ``space`` thinning keeps: ``False`` for a dead channel, one that is
    exactly zero (every producer's filter and bias, every follower's tensors zero there) or that no
    consumer reads (every consumer's input columns zero). ``is_zero(tensor name)`` is the backend's
    elementwise "is zero" of a weight or per-channel tensor. One channel is always kept (a layer needs one).
    """
    zero = None
    for name in [p.weight for p in space.producers] + followers_of(space):
        z = is_zero(name)
        z = z.reshape(z.shape[0], -1).all(1)
        zero = z if zero is None else zero & z
    if zero is None:
        raise ValueError("a space with no producer has no channels to thin")
    unread = None
    for op, _ in space.consumers:
        z = is_zero(op.weight)  # [out, in, ...]: in is channels x features per channel
        columns = np.moveaxis(z, 1, 0).reshape(z.shape[1], -1).all(1)
        u = columns.reshape(zero.size, -1).all(1)
        unread = u if unread is None else unread & u
    keep = ~(zero if unread is None else zero | unread)
    if not keep.any():
        keep[0] = True
    return keep


def input_columns(kept: np.ndarray, channels: int, features: int) -> np.ndarray:
    """A consumer's input columns for the ``kept`` channel indices, when it reads ``features`` inputs
    from ``channels`` channels (after a flatten, ``features / channels`` consecutive ones per channel)."""
    per = features // channels
    return (np.asarray(kept)[:, None] * per + np.arange(per)).reshape(-1)
