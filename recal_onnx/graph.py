"""A small mutable view of an ONNX graph for rewrite passes: nodes, constants, producers, consumers.

Initializers stay ``TensorProto`` until a pass reads one (``const``), so a large model is not
copied into numpy wholesale; a pass that changes a constant stores a new initializer.
"""

from __future__ import annotations

import functools
import itertools
import operator
from collections import defaultdict

import numpy as np
import onnx
from onnx import helper, numpy_helper

MS_DOMAIN = "com.microsoft"


class Graph:
    """Wraps ``model.graph``; call :meth:`commit` to write the nodes back (topologically sorted)."""

    def __init__(self, model: onnx.ModelProto):
        self.model = model
        self.graph = model.graph
        self.nodes: list[onnx.NodeProto] = list(self.graph.node)
        self.initializers: dict[str, onnx.TensorProto] = {t.name: t for t in self.graph.initializer}
        self._original_initializers = set(self.initializers)
        self._arrays: dict[str, np.ndarray] = {}
        self._names = itertools.count()
        self.thinned: dict[str, np.ndarray] = {}  # tensor -> the channels (axis 1) thin_channels kept
        self.kept_float: dict[str, tuple[str, str]] = {}  # node name -> (op type, why a pass left it float)
        self.rounded_biases: dict[str, float] = {}  # node name -> how far its float bias was from an int32 step
        self.ranks: dict[str, int] = {}  # from shape inference, for the tensors it could type
        for info in [*self.graph.input, *self.graph.value_info, *self.graph.output]:
            tensor_type = info.type.tensor_type
            if tensor_type.HasField("shape"):
                self.ranks[info.name] = len(tensor_type.shape.dim)
        self.refresh()

    # --- lookups ----------------------------------------------------------------------------
    def refresh(self) -> None:
        """Rebuild the producer/consumer maps after nodes were added or removed."""
        self.producer: dict[str, onnx.NodeProto] = {}
        self.consumers: dict[str, list[onnx.NodeProto]] = defaultdict(list)
        for node in self.nodes:
            for out in node.output:
                if out:
                    self.producer[out] = node
            for inp in node.input:
                if inp:
                    self.consumers[inp].append(node)
        self.outputs = {o.name for o in self.graph.output}

    def is_const(self, name: str) -> bool:
        return name in self.initializers

    def const(self, name: str) -> np.ndarray | None:
        """The initializer ``name`` as numpy (cached), or None if it is not a constant."""
        if name not in self.initializers:
            return None
        if name not in self._arrays:
            self._arrays[name] = numpy_helper.to_array(self.initializers[name])
        return self._arrays[name]

    def drop_if_unused(self, *names: str) -> None:
        """Forget constants nothing reads any more (keeps memory flat while passes fold weights)."""
        for name in names:
            if name in self.initializers and not self.uses(name):
                del self.initializers[name]
                self._arrays.pop(name, None)

    def release_arrays(self) -> None:
        """Drop the numpy copies of constants (the TensorProtos stay)."""
        self._arrays.clear()

    def each(self, *op_types: str):
        """The nodes of ``op_types`` (every node when none is given) in order, skipping those a rewrite removed
        meanwhile: a pass rewrites the graph while it walks it."""
        for node in list(self.nodes):
            if (not op_types or node.op_type in op_types) and any(map(functools.partial(operator.is_, node),
                                                                       self.nodes)):
                yield node

    def uses(self, name: str) -> int:
        return len(self.consumers.get(name, ())) + (name in self.outputs)

    def only_consumer(self, name: str) -> onnx.NodeProto | None:
        users = self.consumers.get(name, [])
        return users[0] if len(users) == 1 and name not in self.outputs else None

    # --- edits ------------------------------------------------------------------------------
    def fresh(self, base: str) -> str:
        while True:
            name = f"{base}__recal{next(self._names)}"
            if name not in self.initializers and name not in self.producer:
                return name

    def add_const(self, base: str, value: np.ndarray) -> str:
        name = self.fresh(base)
        self.set_const(name, value)
        return name

    def set_const(self, name: str, value: np.ndarray) -> None:
        value = np.asarray(value)
        self.initializers[name] = numpy_helper.from_array(value, name)
        self._arrays[name] = value

    def add_node(self, op_type: str, inputs: list[str], outputs: list[str], name: str = "",
                 domain: str = "", **attrs) -> onnx.NodeProto:
        node = helper.make_node(op_type, inputs, outputs, name=name or self.fresh(op_type), domain=domain or None,
                                **attrs)
        self.nodes.append(node)
        for out in outputs:
            self.producer[out] = node
        for inp in inputs:
            if inp:
                self.consumers[inp].append(node)
        return node

    def remove(self, *nodes: onnx.NodeProto) -> None:
        gone = {id(n) for n in nodes}
        self.nodes = [n for n in self.nodes if id(n) not in gone]
        self.refresh()

    def replace_uses(self, old: str, new: str) -> None:
        """Every consumer of ``old`` reads ``new`` instead (graph outputs keep their names)."""
        for node in self.nodes:
            for i, name in enumerate(node.input):
                if name == old:
                    node.input[i] = new
        self.refresh()

    # --- finishing --------------------------------------------------------------------------
    def remove_dead(self) -> int:
        """Drop nodes whose outputs nobody reads, and unused initializers; return how many nodes went."""
        removed = 0
        while True:
            live = [n for n in self.nodes if any(self.uses(o) for o in n.output if o)]
            if len(live) == len(self.nodes):
                break
            removed += len(self.nodes) - len(live)
            self.nodes = live
            self.refresh()
        used = {i for n in self.nodes for i in n.input} | self.outputs
        for name in list(self.initializers):
            if name not in used:
                del self.initializers[name]
                self._arrays.pop(name, None)
        return removed

    def sorted_nodes(self) -> list[onnx.NodeProto]:
        available = {i.name for i in self.graph.input} | set(self.initializers) | {""}
        pending = list(self.nodes)
        ordered = []
        while pending:
            ready = [n for n in pending if all(i in available for i in n.input)]
            if not ready:
                names = ", ".join(f"{n.op_type} {n.name}" for n in pending[:5])
                raise ValueError(f"the graph has a cycle or a missing input near: {names}")
            ready_ids = {id(n) for n in ready}
            pending = [n for n in pending if id(n) not in ready_ids]
            for n in ready:
                ordered.append(n)
                available.update(n.output)
        return ordered

    def commit(self) -> onnx.ModelProto:
        self.remove_dead()
        self.release_arrays()
        ordered = self.sorted_nodes()
        del self.graph.node[:]
        self.graph.node.extend(ordered)
        tensors = list(self.initializers.values())
        kept = set(self.initializers)
        self.initializers.clear()
        del self.graph.initializer[:]
        while tensors:  # move one at a time, so the old and new lists never both hold every weight
            self.graph.initializer.append(tensors.pop(0))
        del self.graph.value_info[:]  # stale after rewrites (types change); shape inference refills it
        # graph inputs that named an initializer this rewrite removed go too
        kept_inputs = [i for i in self.graph.input if i.name not in self._original_initializers or i.name in kept]
        del self.graph.input[:]
        self.graph.input.extend(kept_inputs)
        if any(n.domain == MS_DOMAIN for n in ordered) and not any(o.domain == MS_DOMAIN for o in self.model.opset_import):
            self.model.opset_import.append(helper.make_opsetid(MS_DOMAIN, 1))
        return self.model


def attr(node: onnx.NodeProto, name: str, default=None):
    for a in node.attribute:
        if a.name == name:
            return helper.get_attribute_value(a)
    return default
