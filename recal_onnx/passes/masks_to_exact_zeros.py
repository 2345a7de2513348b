"""A softmax mask of -100 becomes one of -10000: masked probabilities exactly 0, not float32 denormals.

Before::  scores + Where(mask, -100, 0) -> Softmax -> MatMul(., V)     (or scores + a constant of -100s and 0s)
After::   scores + Where(mask, -10000, 0) -> Softmax -> MatMul(., V)

Swin's shifted-window attention (Hugging Face's and timm's) masks with -100, and exp(-100) = 3.7e-44 is a denormal
float32: in a Swin-tiny, 12-43% of a shifted block's probabilities are. Intel CPUs take a microcode assist for each
denormal an exp or a multiply-add reads or writes. The float attention (attention QAT is off by default) ran
Swin-tiny 1.46x slower on a Xeon (AMX; measured 2026-11) than with its matmuls quantized (probabilities quantized
to 0), where an AMD EPYC ran both alike; the denormals are the difference found (that they cause all of it is
still to be measured on a Xeon). -10000 makes those probabilities 0 for any scores spanning less than
~9900; what they were (below e^-64 = 1.6e-28 of the largest) is below float32's resolution of every output they
add to. Verification compares the result with the QAT model as written, so a model whose masks mean more than that
fails it.

Only a float32 scalar in -10000 < c <= -64 that is a branch of a ``Where`` (Hugging Face's Swin), or such entries
of a constant added to the scores whose every row keeps an entry above -64 (timm's Swin), are changed, and only
where everything that reads them (through data movement, ``Add`` and ``Where`` branches) ends in a ``Softmax``'s
input or reads only its shape: a mask nothing else sees. onnxruntime has a session option for the same
(``session.set_denormal_as_zero``), but it is the user's session's, not the model's.
"""

from __future__ import annotations

import numpy as np

from ..findings import Findings
from ..ir_edits import SHAPE_READERS, Graph, Node, Value, set_input

MASKED = -1.0e4  # exp(MASKED + span) is 0 in float32 for any span below ~9900; finite in float16 too (TensorRT fp16)
MASK_BELOW = -64.0  # a constant this negative masks: exp(-64) = 1.6e-28 of the row's largest probability
MOVES = {"Reshape", "Expand", "Unsqueeze", "Squeeze", "Transpose", "Tile", "Identity", "Slice", "Concat", "Cast"}
MAX_VISITS = 4096  # a mask's path is a few nodes; this bounds the walk on any graph


def masks_to_exact_zeros(g: Graph, findings: Findings | None = None) -> int:
    count = 0
    for softmax in g.each("Softmax"):
        for reader, index, value in _masks(g, softmax.inputs[0]):
            if not _only_softmax_reads(g, reader.outputs[0]):
                continue
            old = reader.inputs[index]
            masked = (value <= MASK_BELOW) & (value > MASKED)
            set_input(reader, index, g.add_const(old.name, np.where(masked, np.float32(MASKED), value)))
            g.drop_if_unused(old)
            if findings is not None:
                findings.masked_scores[reader.name or f"{reader.op_type} before {softmax.name}"] = \
                    float(value[masked].max())
            count += 1
    return count


def _masks(g: Graph, scores: Value) -> list[tuple[Node, int, np.ndarray]]:
    """The ``(reader, input, constant)`` whose constant masks ``scores``, found back through ``Add``, data movement
    and ``Where`` branches: a scalar branch of a ``Where`` (Hugging Face's Swin computes its mask so), or a tensor
    some of whose entries mask and every row of which keeps one that does not (timm's Swin keeps its mask so)."""
    found, seen, stack = [], set(), [(scores, None, 0)]
    while stack and len(seen) < MAX_VISITS:
        value, reader, index = stack.pop()
        c = g.const(value)
        if c is not None:
            if reader is not None and c.dtype == np.float32 and _masks_scores(c, scalar=reader.op_type == "Where"):
                found.append((reader, index, c))
            continue
        node = g.producer(value)
        if node is None or node in seen:
            continue
        seen.add(node)
        if node.op_type == "Where":
            stack += [(node.inputs[1], node, 1), (node.inputs[2], node, 2)]
        elif node.op_type == "Add" or node.op_type == "Concat":
            stack += [(v, node, i) for i, v in enumerate(node.inputs)]
        elif node.op_type in MOVES:
            stack.append((node.inputs[0], node, 0))
    return found


def _masks_scores(c: np.ndarray, scalar: bool) -> bool:
    """A ``Where``'s scalar branch in the mask range, or a tensor with entries in it and, in every row (last axis),
    one above it: the softmax of a row masked whole is its scores' own, which -10000 would blur (their sum with it
    keeps 1e-3 of them)."""
    masked = (c <= MASK_BELOW) & (c > MASKED)
    if scalar:
        return c.size == 1 and bool(masked.all())
    return c.ndim >= 1 and c.size > 1 and bool(masked.any()) and bool((c > MASK_BELOW).any(axis=-1).all())


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
            if (node.op_type == "Softmax" and index == 0) or node.op_type in SHAPE_READERS or node in seen:
                continue
            seen.add(node)
            if node.op_type == "Add" or node.op_type in MOVES and (index == 0 or node.op_type == "Concat") \
                    or node.op_type == "Where" and index in (1, 2):
                stack.extend(node.outputs)
            else:
                return False
    return True
