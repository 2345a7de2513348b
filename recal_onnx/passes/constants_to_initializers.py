"""Constant nodes become initializers of the same name.

Before::  Constant -> X
After::   X (initializer)
"""

from __future__ import annotations

import numpy as np

from ..ir_edits import Graph, Value


def constants_to_initializers(g: Graph) -> int:
    """Each plain ``Constant`` (a ``value`` attribute) becomes an initializer; the passes read initializers."""
    count = 0
    for node in g.each("Constant"):
        if not node.domain and list(node.attributes) == ["value"]:
            becomes_const(g, node.outputs[0], node.attributes["value"].value.numpy())
            g.remove(node)
            count += 1
    return count


def becomes_const(g: Graph, out: Value, value: np.ndarray) -> None:
    """A node output becomes an initializer of the same name (its producer is the caller's to remove)."""
    name, out.name = out.name, None
    g.replace(out, g.add_const(None, value, name=name))
