"""An attention read off a ``torch.export`` graph: the ``linear`` behind each of its query, key and value inputs, and
the ``linear`` its merged heads reach, or why it cannot be followed."""

from __future__ import annotations

import dataclasses

import torch

from recal_core.head_coupling import Attention, HeadLayout, head_layout

from .aten_nodes import MERGE, bias_add_of, matmul_on_weight, projection_of, shape_of, where_of
from .attention_sites import Site, readers
from .head_rows import NotFollowedError, head_rows


def attention_of(site: Site, params: dict[str, str], order: dict[torch.fx.Node, int],
               constants: dict[str, torch.Tensor]) -> Attention:
    """The projections of one attention, its head counts, and what blocks removing its heads (``order``: each node's
    position in the graph; ``constants``: lifted tensor constants by placeholder name)."""
    name = where_of(site.node).split(" (")[0]
    blockers: list[str] = []
    found = []
    targets = (site.query, site.key, site.value)
    for arg in targets:
        linear, path = producer_of(arg, params)
        path.sort(key=order.__getitem__)
        found.append((linear, path))
        if linear is None:
            blockers.append(f"{where_of(arg)} (its query, key and value must each come from one linear)")
    output, merge_path = consumer_of(site.output, params)
    if output is None:
        blockers.append(merge_path or f"whatever reads {name}'s output (not one linear)")
    inside = {n for linear, path in found for n in (linear, *path) if n is not None}
    rows = []
    for role, ((linear, path), arg) in enumerate(zip(found, targets)):
        if linear is None:
            continue
        for n in [linear, *path]:
            for user in readers(n):
                if user is not site.node and user not in site.products and user not in inside:
                    blockers.append(f"{where_of(user)}, which also reads {n.name}")
        try:
            rows.append(head_rows(linear, path, arg, constants, transposed=role == 1 and site.key_transposed))
        except NotFollowedError as exc:
            blockers.append(f"{where_of(exc.node)} (not an op recal follows a head through{exc.why})")
    weights = [params[projection_of(n, params)[1].name] if n is not None else f"{name}.?" for n, _ in found]
    layout = head_layout(tuple(weights), tuple(rows)) if len(rows) == 3 else None
    if isinstance(layout, str):
        blockers.append(f"{name}: {layout}")
    if not isinstance(layout, HeadLayout):  # (counts for messages only: nothing is removed)
        shape = shape_of(site.query) or (1, 1, 1, 1)
        layout = HeadLayout(shape[-3], shape[-3], shape[-1], (0, 0, 0), False)
    projections = (projection_of(n, params) for n, _ in found if n is not None)
    biases = tuple(dict.fromkeys((params[w.name], params[b.name]) for _, w, b in projections
                                 if isinstance(b, torch.fx.Node) and b.name in params))
    att = Attention(name, *weights, params[projection_of(output, params)[1].name] if output is not None else
                    f"{name}.?", layout.heads, layout.kv_heads, layout.head_dim, biases, offsets=layout.offsets,
                    interleaved=layout.interleaved)
    if not blockers:
        blockers += filter(None, [att.packing_problem({w: shape_of(n)[-1] for w, (n, _) in zip(weights, found)})])
    return dataclasses.replace(att, blockers=tuple(dict.fromkeys(blockers)))


def producer_of(node: torch.fx.Node, params: dict[str, str]) -> tuple[torch.fx.Node | None, list[torch.fx.Node]]:
    """The one ``linear`` (or Conv1D ``addmm``) on a parameter whose output reaches ``node``, and the ops on the
    way (head splits, rotary embeddings): inputs that no linear reaches (cos and sin tables) are not followed."""
    path: list[torch.fx.Node] = []
    linears: set[torch.fx.Node] = set()
    seen: set[torch.fx.Node] = set()
    stack = [node]
    while stack:
        n = stack.pop()
        if n in seen or not isinstance(n, torch.fx.Node):
            continue
        seen.add(n)
        if projection_of(n, params):
            linears.add(n)
            continue
        if n.op != "call_function" or not reaches_linear(n, params):
            continue
        path.append(n)
        stack.extend(n.all_input_nodes)
    if len(linears) != 1:
        return None, path
    return linears.pop(), path[::-1]


def reaches_linear(node: torch.fx.Node, params: dict[str, str]) -> bool:
    seen, stack = set(), [node]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if projection_of(n, params):
            return True
        stack.extend(n.all_input_nodes)
    return False


def consumer_of(heads: torch.fx.Node, params: dict[str, str]) -> tuple[torch.fx.Node | None, str | None]:
    """The ``linear`` that reads the attention's ``heads`` merged back (through transposes and reshapes only)."""
    n = heads
    while True:
        users = readers(n)
        if len(users) != 1:
            return None, f"{len(users)} readers of {n.name}" if users else None
        user = users[0]
        user = bias_add_of(user, params) or user if matmul_on_weight(user, params) else user
        if (projection := projection_of(user, params)) is not None and projection[0] is n:
            return user, None
        if user.target not in MERGE:
            return None, f"{where_of(user)} (reads {heads.name}'s output; recal follows only reshapes to a linear)"
        n = user
