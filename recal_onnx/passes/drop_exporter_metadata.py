"""The torch exporter's per-node debugging record is not carried into the integer model.

torch.onnx's dynamo exporter writes on every node where it came from: the module path (``namespace``), the class
hierarchy, the fx node and the Python stack trace (``pkg.torch.onnx.*``), about 2 KB a node. In a small decoder that
is as many bytes as its int4 weights, and the stack traces name files on the machine that exported it. The converter
reads the module paths for its messages before its pipeline runs (:func:`recal_onnx.float_report.module_paths`), and
this, its last step, drops these keys; any other metadata a node carries is kept, and ``keep_exporter_metadata=True``
keeps them all.

Before::  Mul {namespace: "lm: LlamaForCausalLM/...", pkg.torch.onnx.stack_trace: "File ...", other: "x"}
After::   Mul {other: "x"}
"""

from __future__ import annotations

import onnx_ir as ir

from ..ir_edits import Graph

def is_exporter_key(key: str) -> bool:
    """Whether a node's metadata ``key`` is the torch exporter's record."""
    return key == "namespace" or key.startswith("pkg.torch.onnx.")


def drop_exporter_metadata(g: Graph) -> int:
    """Remove the exporter's debugging keys from every node (subgraphs too); return how many bytes of text went."""
    dropped = 0
    for node in ir.traversal.RecursiveGraphIterator(g.graph):
        props = node.metadata_props
        for key in [k for k in props if is_exporter_key(k)]:
            dropped += len(key) + len(props.pop(key))
    return dropped
