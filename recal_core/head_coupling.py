"""Which weights prune one attention head together: the rules ``mask_type: head`` and thinning share.

A backend describes each attention it traced as an :class:`Attention`: the layers whose outputs become its
queries, keys and values (``heads * head_dim`` rows each, head-major), the layers that read its merged
output (``heads * head_dim`` input columns) and what else touches those tensors. Head ``h`` is rows
``h*d:(h+1)*d`` of the query, key and value projections and the same columns of the output projection.
With grouped-query attention (``kv_heads < heads``) the unit is a key/value head with the
``heads / kv_heads`` query heads that read it, so removing a unit leaves an attention that still runs.
A packed projection (GPT-2's ``c_attn``: Q, K and V as consecutive row blocks of one weight) holds a unit's
rows once in each block: its width is one per block, in row order.

A head-pruning modifier lists the four projections of each attention together; the group ranks its units
by their summed squared norms (rows of Q, K, V and columns of the output projection) and zeroes the
lowest. What cannot be pruned that way is a :class:`~recal_core.channel_coupling.CouplingError` naming the
layer and what blocks it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .channel_coupling import CouplingError

Width = int | tuple[int, ...]  # rows per unit: one block, or one per block of a packed weight


@dataclass(frozen=True)
class Attention:
    """One traced attention, by parameter names."""

    name: str  # the attention module's name (for messages)
    query: str  # weights [heads * head_dim, hidden] (canonical [out, in])
    key: str  # [kv_heads * head_dim, hidden]
    value: str
    output: str  # [hidden, heads * head_dim]: the layer reading the merged heads
    heads: int
    kv_heads: int
    head_dim: int
    biases: tuple[tuple[str, str], ...] = ()  # (projection weight, its bias) for the query, key and value
    blockers: tuple[str, ...] = ()  # why its heads cannot be removed (another reader, an op not followed)
    offsets: tuple[int, int, int] = (0, 0, 0)  # the first row of the query, key and value in their weights

    @property
    def per_unit(self) -> int:
        """Query heads per pruned unit: 1, or the query heads sharing one key/value head."""
        return self.heads // self.kv_heads

    def projections(self) -> tuple[tuple[str, int, int], ...]:
        """``(weight, first row, rows per unit)`` of the query, key and value."""
        return ((self.query, self.offsets[0], self.per_unit * self.head_dim),
                (self.key, self.offsets[1], self.head_dim), (self.value, self.offsets[2], self.head_dim))

    def widths(self) -> dict[str, Width]:
        """Rows (Q, K, V) or columns (output) each weight holds per unit: one width per projection a packed
        weight holds, in the order of its rows."""
        held: dict[str, list[tuple[int, int]]] = {}
        for weight, offset, width in self.projections():
            held.setdefault(weight, []).append((offset, width))
        out: dict[str, Width] = {w: blocks[0][1] if len(blocks) == 1 else tuple(x for _, x in sorted(blocks))
                                 for w, blocks in held.items()}
        out[self.output] = self.per_unit * self.head_dim
        return out

    def packing_problem(self, rows: dict[str, int]) -> str | None:
        """Why the projections sharing one weight (of ``rows[weight]`` rows) do not fill it block after block
        (None: they do, or none share one): only then is a unit's set of rows known."""
        for weight in {w for w, _, _ in self.projections()}:
            blocks = sorted((o, x * self.kv_heads) for w, o, x in self.projections() if w == weight)
            ends = [o + n for o, n in blocks]
            if len(blocks) > 1 and ([o for o, _ in blocks] != [0, *ends[:-1]] or rows.get(weight) != ends[-1]):
                return (f"{weight}: its query, key and value rows {[(o, e) for (o, _), e in zip(blocks, ends)]} do "
                        f"not fill its {rows.get(weight)} rows one block after another")
        return None

    def bias_widths(self) -> dict[str, Width]:
        """Elements per unit of each bias."""
        widths = self.widths()
        return {bias: widths[weight] for weight, bias in self.biases}


def head_groups(attentions: list[Attention], pruned: dict[str, tuple[int, str]]) -> list[tuple[Attention, int]]:
    """The attentions a recipe prunes by head, each with its modifier's index, from the weights pruned
    ``head`` (``pruned[weight] = (modifier index, kind)``). A :class:`CouplingError` for a weight that is no
    traced attention's projection, an attention missing one of its four projections or shared by two
    modifiers, or one whose heads something else reads."""
    heads = {w: m for w, (m, kind) in pruned.items() if kind == "head"}
    roles = {}
    for att in attentions:
        for role, weight in (("query", att.query), ("key", att.key), ("value", att.value), ("output", att.output)):
            roles[weight] = (att, role)
    out: dict[str, tuple[Attention, int]] = {}
    for weight, modifier in heads.items():
        if weight not in roles:
            if not attentions:
                found = ("none traced in this model: one built with attn_implementation='eager' has none; build "
                         "it with 'sdpa', the default")
            else:
                blocked = next((a for a in attentions if a.blockers), None)
                found = f"{len(attentions)} traced in this model" + (
                    f"; {blocked.name}'s heads cannot be followed: {blocked.blockers[0]}" if blocked else "")
            raise CouplingError(
                f"{weight}: mask_type head: recal traced no attention that reads it as a query, key, value or "
                f"output projection (it finds attentions through scaled_dot_product_attention; {found}); list "
                "only the four projections of each attention", modifier)
        att, role = roles[weight]
        if att.blockers:
            raise CouplingError(f"{att.name}: mask_type head: its heads also reach {att.blockers[0]}, so they "
                                "cannot be removed; prune this attention's projections unstructured, or leave it "
                                "out of params", modifier)
        missing = [w for w in dict.fromkeys((att.query, att.key, att.value, att.output)) if heads.get(w) != modifier]
        if missing:
            raise CouplingError(
                f"{att.name}: mask_type head on {weight} ({role}): a head is rows of the query, key and value "
                f"projections and columns of the output projection, pruned together; list "
                f"{', '.join(missing)} in the same modifier with mask_type head", modifier)
        out[att.name] = (att, modifier)
    return list(out.values())


def live_heads(att: Attention, is_zero) -> np.ndarray:
    """Which units of ``att`` thinning keeps: ``False`` where the unit's output is exactly zero (its value
    rows and value bias are zero) or unread (its output-projection columns are zero). ``is_zero(name)`` is
    the backend's elementwise "is zero" of a weight or bias in canonical ``[out, in]`` order. One unit is
    always kept (an attention needs one)."""
    units = att.kv_heads
    _, start, width = att.projections()[2]

    def value_rows(name: str) -> np.ndarray:
        return is_zero(name)[start:start + units * width].reshape(units, -1).all(1)

    value = value_rows(att.value)
    for weight, bias in dict(att.biases).items():
        if weight == att.value:
            value &= value_rows(bias)
    unread = np.moveaxis(is_zero(att.output), 1, 0).reshape(units, -1).all(1)
    keep = ~(value | unread)
    if not keep.any():
        keep[0] = True
    return keep


def unit_rows(kept: np.ndarray, width: Width, units: int) -> np.ndarray:
    """The rows (or columns) of a weight of ``units`` units holding ``width`` per unit (one block, or one width
    per block of a packed weight), for the ``kept`` unit indices."""
    out, start = [], 0
    for w in (width,) if isinstance(width, int) else width:
        out.append((start + np.asarray(kept)[:, None] * w + np.arange(w)).reshape(-1))
        start += units * w
    return np.concatenate(out)
