"""Nodes no graph output reads go, before any pattern is matched."""

from __future__ import annotations

from ..ir_edits import Graph


def remove_dead_nodes(g: Graph) -> int:
    """Nodes whose outputs reach no graph output go first (onnxruntime drops them too): a value they read would
    otherwise look read outside the pattern it belongs to (an elementwise island, a layer and its Q)."""
    return g.remove_dead()
