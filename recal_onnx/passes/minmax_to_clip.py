"""A ``Max`` / ``Min`` of a tensor and a scalar constant is the ``Clip`` it computes.

Before::  y -> Max(y, 0) -> Min(., 6) -> QuantizeLinear
After::   y -> Clip(y, 0, 6) -> QuantizeLinear

jax2onnx writes ``relu6`` (``jnp.clip``) and ``relu`` (``jnp.maximum(x, 0)``) this way, so a JAX export's
``Conv -> Max -> Min -> QuantizeLinear`` is the ReLU6 tail the integer passes fold into a QLinearConv, once it reads
as the Clip that torch.onnx and tf2onnx write.
"""

from __future__ import annotations

import numpy as np

from ..ir_edits import Graph, Node, Value


def _scalar_bound(g: Graph, node: Node) -> tuple[Value, np.ndarray] | None:
    """``(tensor, bound)`` of a two-input Max / Min whose other input is a one-element float constant (as a 0-d
    array of its dtype) no wider in rank than the tensor: one that broadcasts the tensor to more axes is no clip."""
    if len(node.inputs) != 2:
        return None
    for data, other in ((node.inputs[0], node.inputs[1]), (node.inputs[1], node.inputs[0])):
        value = g.const(other)
        rank = g.rank(data)
        if value is not None and value.size == 1 and value.dtype.kind == "f" and not g.is_const(data) \
                and rank is not None and value.ndim <= rank:
            return data, value.reshape(())
    return None


def minmax_to_clip(g: Graph) -> int:
    count = 0
    for node in g.each("Max", "Min"):  # skips a Min taken with the Max before it
        found = _scalar_bound(g, node)
        if found is None:
            continue
        x, bound = found
        bounds = {"Max": None, "Min": None}
        bounds[node.op_type] = bound
        last = node
        after = g.only_consumer(node.outputs[0])
        if after is not None and after.op_type in bounds and after.op_type != node.op_type:
            then = _scalar_bound(g, after)
            # bounds that cross are two one-sided clips: Clip with min > max computes neither order
            if then is not None and then[0] is node.outputs[0] and \
                    (node.op_type == "Max") == (bound <= then[1]):
                bounds[after.op_type], last = then[1], after
        low, high = bounds["Max"], bounds["Min"]
        inputs = [x] + [None if b is None else g.add_const(f"{node.name}_{k}", b)
                        for k, b in (("min", low), ("max", high))]
        while inputs[-1] is None:
            inputs.pop()
        g.add_node("Clip", inputs, name=f"{node.name}_clip", replaces=last.outputs[0])
        g.remove(*{id(n): n for n in (node, last)}.values())
        count += 1
    return count
