"""Identity nodes, Casts to the type they read and single-input Concats go; their readers read their input.

Before::  W -> Identity -> Y -> Conv
After::   W -> Conv
"""

from __future__ import annotations

from ..ir_edits import Graph, Node


def remove_identities(g: Graph) -> int:
    """Identity nodes, Casts to the type they read (ModelOpt writes float-to-float ones on residual paths), and
    Concats of a single input (``torch.cat([x])``: DenseNet's first layer), go."""
    count = 0
    for node in g.each("Identity", "Concat", "Cast"):
        if node.op_type == "Concat" and len(node.inputs) != 1:
            continue
        if node.op_type == "Cast" and not _same_type_cast(node):
            continue
        if not node.outputs[0].is_graph_output():
            g.replace(node.outputs[0], node.inputs[0])
            g.remove(node)
            count += 1
    return count


def _same_type_cast(node: Node) -> bool:
    to, source = node.attributes.get("to"), node.inputs[0] if node.inputs else None
    return (to is not None and source is not None and source.type is not None
            and int(to.value) == int(source.type.dtype))
