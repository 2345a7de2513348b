"""The converter's graph: an ``onnx_ir`` model, and the few lookups and edits every rewrite pass shares.

``onnx_ir`` keeps each value's producer and uses up to date as nodes change, so a pass reads ``value.producer()``
and rewires with ``replace_input_with``; what this module adds is constants as numpy (cached: a weight is read by
several passes), fresh names, and the rule that a node standing in for another keeps its output's name and shape
(verification and the zoo compare tensors by name). Initializers stay the ``TensorProto`` they were read from until
a pass replaces one, so a large model is not copied into numpy wholesale.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence

import numpy as np
import onnx
import onnx_ir as ir

MS_DOMAIN = "com.microsoft"

Value = ir.Value
Node = ir.Node

EXTERNAL_DATA_BYTES = 1_800_000_000  # above this a model's tensors go to <name>.data (protobuf's limit is 2 GB)

SHAPE_READERS = ("Shape", "Size")  # ops that read only a tensor's shape: any tensor of that shape will do
LAYOUT_OPS = ("Transpose", "Reshape", "Flatten", "Squeeze", "Unsqueeze", "Identity")  # move values, change none


class Graph:
    """A model being rewritten; :meth:`commit` returns it as a ``ModelProto`` (dead nodes gone, sorted)."""

    def __init__(self, model: onnx.ModelProto):
        self.model = ir.serde.deserialize_model(model)
        self.graph = self.model.graph
        self._arrays: dict[Value, np.ndarray] = {}
        self._counter = itertools.count()
        self._names = {v.name for v in self._values() if v.name} | {n.name for n in self.graph if n.name}

    def _values(self) -> Iterator[Value]:
        yield from self.graph.inputs
        yield from self.graph.initializers.values()
        for node in self.graph:
            yield from node.outputs

    # --- lookups ----------------------------------------------------------------------------
    @property
    def nodes(self) -> list[Node]:
        return list(self.graph)

    @property
    def opset(self) -> int:
        return self.model.opset_imports.get("", 17)

    def each(self, *op_types: str) -> Iterator[Node]:
        """The nodes of ``op_types`` (every node when none is given) in order, skipping those a rewrite removed
        meanwhile: a pass rewrites the graph while it walks it."""
        for node in list(self.graph):
            if (not op_types or node.op_type in op_types) and node.graph is self.graph:
                yield node

    @staticmethod
    def is_const(value: Value | None) -> bool:
        return value is not None and value.is_initializer()

    def const(self, value: Value | None) -> np.ndarray | None:
        """The initializer ``value`` as numpy (cached), or None if it is not a constant."""
        if not self.is_const(value):
            return None
        if value not in self._arrays:
            self._arrays[value] = value.const_value.numpy()
        return self._arrays[value]

    @staticmethod
    def producer(value: Value | None) -> Node | None:
        return None if value is None else value.producer()

    @staticmethod
    def consumers(value: Value) -> list[Node]:
        return list(dict.fromkeys(use.node for use in value.uses()))

    @staticmethod
    def uses(value: Value) -> int:
        return len(value.uses()) + value.is_graph_output()

    def only_consumer(self, value: Value) -> Node | None:
        """The node that alone reads ``value`` (once), unless ``value`` is also a graph output."""
        users = value.uses()
        return users[0].node if len(users) == 1 and not value.is_graph_output() else None

    @staticmethod
    def rank(value: Value | None) -> int | None:
        """The rank shape inference gave ``value`` (or a constant's), None when unknown."""
        if value is None:
            return None
        if value.shape is not None:
            return len(value.shape)
        return value.const_value.ndim if value.const_value is not None else None

    # --- edits ------------------------------------------------------------------------------
    def fresh(self, base: str | None) -> str:
        while True:
            name = f"{base or 'value'}__recal{next(self._counter)}"
            if name not in self._names:
                self._names.add(name)
                return name

    def add_const(self, base: str | None, value: np.ndarray, name: str | None = None) -> Value:
        """A new initializer holding ``value``, named after ``base`` (or exactly ``name``)."""
        array = np.asarray(value)
        const = ir.Value(name=name or self.fresh(base), shape=ir.Shape(array.shape),
                         type=ir.TensorType(ir.DataType.from_numpy(array.dtype)), const_value=ir.tensor(array))
        self.graph.register_initializer(const)
        self._arrays[const] = array
        return const

    def add_node(self, op_type: str, inputs: Sequence[Value | None], *, name: str = "", domain: str = "",
                 outputs: int = 1, replaces: Value | None = None, **attrs) -> Node:
        """Append a node. With ``replaces``, its output stands in for that value: every reader (graph output
        too) reads it instead, and it takes the value's name and shape."""
        if not name or name in self._names:  # node names are unique in a valid model (an exporter's may be empty)
            name = self.fresh(name or op_type)
        else:
            self._names.add(name)
        node = ir.node(op_type, list(inputs), attrs, domain=domain, num_outputs=outputs, name=name)
        for out in node.outputs:
            out.name = self.fresh(node.name)
        self.graph.append(node)
        if replaces is not None:
            self.replace(replaces, node.outputs[0], rename=True)
        return node

    def remove(self, *nodes: Node) -> None:
        """Take ``nodes`` out of the graph; they no longer read their inputs (their outputs' readers are the
        caller's to rewire)."""
        for node in nodes:
            node.resize_inputs(0)
        self.graph.remove(nodes)

    def replace(self, old: Value, new: Value, rename: bool = False) -> None:
        """Every reader of ``old`` reads ``new`` instead; a graph output keeps its name (as does ``new`` from a
        node that stands in for ``old``, with ``rename``)."""
        if old is new:
            return
        if rename or old.is_graph_output():
            name, shape, type_ = old.name, old.shape, old.type
            old.replace_all_uses_with(new, replace_graph_outputs=True)
            if not old.is_initializer() and not new.is_initializer() and new not in self.graph.inputs:
                old.name = None
                new.name = name
                new.shape = new.shape or shape
                new.type = new.type or type_
        else:
            old.replace_all_uses_with(new)

    def drop_if_unused(self, *values: Value) -> None:
        """Forget constants nothing reads any more (keeps memory flat while passes fold weights); one an old model
        also lists as a graph input goes from the inputs too."""
        for value in values:
            if value.is_initializer() and not self.uses(value):
                if value in self.graph.inputs:
                    self.graph.inputs.remove(value)
                self.graph.initializers.pop(value.name)
                self._arrays.pop(value, None)

    # --- finishing --------------------------------------------------------------------------
    def remove_dead(self) -> int:
        """Drop nodes whose outputs nobody reads, and unused initializers; return how many nodes went."""
        self.graph.sort()
        removed = 0
        for node in reversed(list(self.graph)):
            if not any(self.uses(out) for out in node.outputs):
                self.remove(node)
                removed += 1
        self.drop_if_unused(*self.graph.initializers.values())
        return removed

    def commit(self) -> onnx.ModelProto:
        """The model as a ``ModelProto``: dead nodes gone, topologically sorted, ``com.microsoft`` imported
        where its ops are used; ``value_info`` is left to shape inference (types change in a rewrite)."""
        self.remove_dead()
        self._arrays.clear()
        if any(node.domain == MS_DOMAIN for node in self.graph):
            self.model.opset_imports.setdefault(MS_DOMAIN, 1)
        proto = ir.serde.serialize_model(self.model)
        del proto.graph.value_info[:]
        return proto


def attr(node: Node, name: str, default=None):
    value = node.attributes.get(name)
    return default if value is None else value.value


def set_attr(node: Node, name: str, value) -> None:
    node.attributes[name] = ir.convenience.convert_attribute(name, value)


def input_of(node: Node, index: int) -> Value | None:
    """``node``'s input ``index``, None where it is missing or left out."""
    return node.inputs[index] if len(node.inputs) > index else None


def set_input(node: Node, index: int, value: Value) -> None:
    """``node`` reads ``value`` as input ``index``, its inputs grown where it had fewer (adding an optional bias or
    zero point; optional inputs before it stay left out)."""
    if len(node.inputs) <= index:
        node.resize_inputs(index + 1)
    node.replace_input_with(index, value)
