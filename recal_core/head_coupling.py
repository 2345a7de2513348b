"""Which weights prune one attention head together: the rules ``mask_type: head`` and thinning share.

A backend describes each attention it traced as an :class:`Attention`: the layers whose outputs become its
queries, keys and values (``heads * head_dim`` rows each, head-major), the layers that read its merged
output (``heads * head_dim`` input columns) and what else touches those tensors. Head ``h`` is rows
``h*d:(h+1)*d`` of the query, key and value projections and the same columns of the output projection.
With grouped-query attention (``kv_heads < heads``) the unit is a key/value head with the
``heads / kv_heads`` query heads that read it, so removing a unit leaves an attention that still runs.
A packed projection holds a unit's rows either once in each block (GPT-2's ``c_attn``: Q, K and V as
consecutive row blocks of one weight; its width is one per block, in row order) or together, one unit after
another (GPT-NeoX's ``query_key_value``: each head's Q, K and V rows side by side; its width is their sum).
:func:`head_layout` reads which from the rows each head was traced to read.

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
    # the weight holding more than one of Q, K and V holds each unit's rows together (offsets: within a unit)
    interleaved: bool = False

    @property
    def per_unit(self) -> int:
        """Query heads per pruned unit: 1, or the query heads sharing one key/value head."""
        return self.heads // self.kv_heads

    def _shared(self, weight: str) -> bool:
        return [self.query, self.key, self.value].count(weight) > 1

    def unit_span(self, weight: str) -> int:
        """The rows of ``weight`` one unit holds: from one unit to the next where it holds them together."""
        return sum(x for w, _, x in self.projections() if w == weight)

    def rows(self, role: int) -> np.ndarray:
        """``[kv_heads, width]``: the rows of the query (0), key (1) or value (2) each unit reads."""
        weight, start, width = self.projections()[role]
        step = self.unit_span(weight) if self.interleaved and self._shared(weight) else width
        return start + np.arange(self.kv_heads)[:, None] * step + np.arange(width)

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
        out: dict[str, Width] = {w: blocks[0][1] if len(blocks) == 1 else self.unit_span(w)
                                 if self.interleaved else tuple(x for _, x in sorted(blocks))
                                 for w, blocks in held.items()}
        out[self.output] = self.per_unit * self.head_dim
        return out

    def packing_problem(self, rows: dict[str, int]) -> str | None:
        """Why the projections sharing one weight (of ``rows[weight]`` rows; and any other weight ``rows`` names)
        do not fill it block after block (None: they do): only then is a unit's set of rows known."""
        for weight in {w for w, _, _ in self.projections()}:
            if self.interleaved and self._shared(weight):  # one unit's blocks fill its span; the units, the weight
                blocks = sorted((o, x) for w, o, x in self.projections() if w == weight)
                ends = [o + n for o, n in blocks]
                if [o for o, _ in blocks] != [0, *ends[:-1]] or rows.get(weight) != ends[-1] * self.kv_heads:
                    return (f"{weight}: its query, key and value rows {blocks} of each of {self.kv_heads} heads do "
                            f"not fill its {rows.get(weight)} rows one head after another")
                continue
            blocks = sorted((o, x * self.kv_heads) for w, o, x in self.projections() if w == weight)
            ends = [o + n for o, n in blocks]
            if (len(blocks) > 1 or weight in rows) and ([o for o, _ in blocks] != [0, *ends[:-1]]
                                                        or rows.get(weight) != ends[-1]):
                return (f"{weight}: its query, key and value rows {[(o, e) for (o, _), e in zip(blocks, ends)]} do "
                        f"not fill its {rows.get(weight)} rows one block after another")
        return None

    def bias_widths(self) -> dict[str, Width]:
        """Elements per unit of each bias."""
        widths = self.widths()
        return {bias: widths[weight] for weight, bias in self.biases}


@dataclass(frozen=True)
class HeadLayout:
    """Where an attention's heads are in its projections: the :class:`Attention` fields :func:`head_layout`
    reads off the rows each head was traced to."""

    heads: int
    kv_heads: int
    head_dim: int
    offsets: tuple[int, int, int]
    interleaved: bool


def head_layout(weights: tuple[str, str, str], rows: tuple[np.ndarray, np.ndarray, np.ndarray],
                ) -> HeadLayout | str:
    """The units of an attention from ``rows``: for its query, key and value, ``[heads, head_dim]``, the rows
    of its projection's weight (``weights``) each head of the attention computes from, as traced (key and value
    heads repeated for grouped-query attention are the same rows). A string says why they are no layout whose
    units thinning can slice: a unit's query heads consecutive, its rows consecutive, one unit after the next
    in each weight (as blocks, or all its rows together where Q, K and V share a weight)."""
    q, k, v = (np.asarray(r) for r in rows)
    heads, head_dim = q.shape
    if k.shape[1] != head_dim or v.shape != k.shape or heads % k.shape[0]:
        return (f"its query heads {q.shape}, key heads {k.shape} and value heads {v.shape} ([heads, head size]) "
                "are not one head size with the query heads shared evenly")
    key_sets = [tuple(np.sort(r)) for r in k]
    units = list(dict.fromkeys(key_sets))
    unit_of_key = [units.index(s) for s in key_sets]
    kv = len(units)
    value_of = {}
    for u, r in zip(unit_of_key, v):
        value_of.setdefault(u, set()).add(tuple(np.sort(r)))
    if heads % kv or any(len(s) != 1 for s in value_of.values()) or \
            len({next(iter(s)) for s in value_of.values()}) != kv:
        return f"its {k.shape[0]} key heads and value heads do not pair into key/value heads one to one"
    per_unit = heads // kv
    key_of_query = np.arange(heads) // (heads // k.shape[0])
    if [unit_of_key[j] for j in key_of_query] != list(np.arange(heads) // per_unit):
        return "the query heads sharing one key/value head are not consecutive"
    if np.unique(q).size != q.size:
        return "two of its query heads read the same rows"
    first_key = [unit_of_key.index(u) for u in range(kv)]
    per_role = [np.sort(q.reshape(kv, -1), axis=1), np.sort(k[first_key], axis=1), np.sort(v[first_key], axis=1)]
    starts, steps = [], []
    for role, r, weight in zip(("query", "key", "value"), per_role, weights):
        if not (r == r[:, :1] + np.arange(r.shape[1])).all():
            return f"the {role} rows of one key/value head are not consecutive in {weight}"
        step = np.diff(r[:, 0])
        if step.size and not (step == step[0]).all():
            return f"its {role} heads are not evenly spaced in their weight"
        starts.append(int(r[0, 0]))
        steps.append(int(step[0]) if step.size else r.shape[1])
    widths = [r.shape[1] for r in per_role]
    shared = [weights.count(w) > 1 for w in weights]
    interleaved = kv > 1 and any(s and step != width for s, step, width in zip(shared, steps, widths))
    for w, start, step, width, is_shared in zip(weights, starts, steps, widths, shared):
        span = sum(x for o, x in zip(weights, widths) if o == w) if interleaved and is_shared else width
        if kv > 1 and step != span:
            return (f"{w}: its heads are {step} rows apart, neither one block of heads ({width}) nor one head's "
                    f"query, key and value together ({span})")
        if not is_shared and start != 0:
            return f"{w}: its heads start at row {start}, not 0"
    return HeadLayout(heads, kv, head_dim, (starts[0], starts[1], starts[2]), interleaved)


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
                found = ("none traced in this model: an attention whose scores are not one matmul of queries and "
                         "keys (an einsum, a custom kernel) is not found; write it with "
                         "scaled_dot_product_attention")
            else:
                blocked = next((a for a in attentions if a.blockers), None)
                found = f"{len(attentions)} traced in this model" + (
                    f"; {blocked.name}'s heads cannot be followed: {blocked.blockers[0]}" if blocked else "")
            raise CouplingError(
                f"{weight}: mask_type head: recal traced no attention that reads it as a query, key, value or "
                f"output projection (it finds attentions through scaled_dot_product_attention or softmax(q @ kᵀ) @ v "
                f"written out; {found}); list "
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
    rows = att.rows(2)

    def value_rows(name: str) -> np.ndarray:
        return is_zero(name)[rows].reshape(units, -1).all(1)

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
