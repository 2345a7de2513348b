"""A softmax mask of -100 becomes one of -10000: masked probabilities exactly 0, not float32 denormals.

Before::  scores + Where(mask, -100, 0) -> Softmax -> MatMul(., V)
After::   scores + Where(mask, -10000, 0) -> Softmax -> MatMul(., V)

Swin's shifted-window attention (Hugging Face's and timm's) masks with -100, and exp(-100) = 3.7e-44 is a denormal
float32: in a Swin-tiny, 12-43% of a shifted block's probabilities are. Intel CPUs take a microcode assist for each
denormal an exp or a multiply-add reads or writes, so the float attention (attention QAT is off by default) ran
Swin-tiny 1.46x slower on a Xeon than with its matmuls quantized (probabilities quantized to 0), while an AMD EPYC
ran both alike. -10000 makes those probabilities 0 for any scores spanning less than ~9900; what they were (below
e^-64 = 1.6e-28 of the largest) is below float32's resolution of every output they add to. Verification compares the
result with the QAT model as written, so a model whose masks mean more than that fails it.

Only a float32 scalar in -10000 < c <= -64 that is a branch of a ``Where`` is changed, and only where everything
that reads it (through data movement, ``Add`` and ``Where`` branches) ends in a ``Softmax``'s input or reads only
its shape: a mask nothing else sees. onnxruntime has a session option for the same (``session.set_denormal_as_zero``), but it is the user's
session's, not the model's.
"""

from __future__ import annotations

import numpy as np

from ..findings import Findings
from ..graph import Graph, Node, Value, set_input

MASKED = -1.0e4  # exp(MASKED + span) is 0 in float32 for any span of scores below ~9900
MASK_BELOW = -64.0  # a constant this negative masks: exp(-64) = 1.6e-28 of the row's largest probability
MOVES = {"Reshape", "Expand", "Unsqueeze", "Squeeze", "Transpose", "Tile", "Identity", "Slice", "Concat", "Cast"}
SHAPE_ONLY = {"Shape", "Size"}  # readers of a mask's shape, not its values
MAX_VISITS = 4096  # a mask's path is a few nodes; this bounds the walk on any graph


def masks_to_exact_zeros(g: Graph, findings: Findings | None = None) -> int:
    count = 0
    for softmax in g.each("Softmax"):
        for where, index, value in _masks(g, softmax.inputs[0]):
            if not _only_softmax_reads(g, where.outputs[0]):
                continue
            old = where.inputs[index]
            set_input(where, index, g.add_const(old.name, np.full_like(value, MASKED)))
            g.drop_if_unused(old)
            if findings is not None:
                findings.masked_scores[where.name or f"Where before {softmax.name}"] = value.item()
            count += 1
    return count


def _masks(g: Graph, scores: Value) -> list[tuple[Node, int, np.ndarray]]:
    """The ``(Where, branch, constant)`` whose constant masks ``scores``, found back through ``Add``, data movement
    and ``Where`` branches."""
    found, seen, stack = [], set(), [scores]
    while stack and len(seen) < MAX_VISITS:
        value = stack.pop()
        node = g.producer(value)
        if node is None or node in seen:
            continue
        seen.add(node)
        if node.op_type == "Where":
            for index in (1, 2):
                c = g.const(node.inputs[index])
                if c is not None and c.size == 1 and c.dtype == np.float32 and MASKED < c.item() <= MASK_BELOW:
                    found.append((node, index, c))
                elif c is None:
                    stack.append(node.inputs[index])
        elif node.op_type == "Add":
            stack.extend(node.inputs)
        elif node.op_type in MOVES:
            stack.extend(node.inputs if node.op_type == "Concat" else node.inputs[:1])
    return found


def _only_softmax_reads(g: Graph, value: Value) -> bool:
    """Whether every reader of ``value``, followed through data movement, ``Add`` and ``Where`` branches, ends in a
    Softmax's input or reads only its shape (and none is a graph output)."""
    seen, stack = set(), [value]
    while stack:
        value = stack.pop()
        if value.is_graph_output() or len(seen) >= MAX_VISITS:
            return False
        for use in value.uses():
            node, index = use.node, use.idx
            if (node.op_type == "Softmax" and index == 0) or node.op_type in SHAPE_ONLY or node in seen:
                continue
            seen.add(node)
            if node.op_type == "Add" or node.op_type in MOVES and (index == 0 or node.op_type == "Concat") \
                    or node.op_type == "Where" and index in (1, 2):
                stack.extend(node.outputs)
            else:
                return False
    return True
