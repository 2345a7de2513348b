"""A weight-only layer (W4A16, W8A16, W2A16) becomes onnxruntime's ``MatMulNBits``: float input, 2-, 4- or 8-bit
weights.

recal's export writes a weight-only layer's integers as rows of one group each, ``[out * groups, group_size]``, with
a per-row (per-channel, axis 0) DequantizeLinear reshaped to ``[out, in]`` (:mod:`recal_torch.export.modules`): a form
every exporter and opset >= 13 writes and onnxruntime runs as it is. ``MatMulNBits`` keeps the integers packed (four
ternary values a byte, zero point 2; two 4-bit values, zero point 8; or bytes, zero point 128) with one scale per
block of ``group_size`` inputs, and dequantizes a block at a time inside its GEMM: a smaller file and less memory
traffic than a float weight.

Before::  q [N*K/G, G] -> DequantizeLinear(s, axis=0) -> Reshape [N, K] -> Transpose -> MatMul(x, .)   (+ Add(b))
          (or Gemm(x, ., b, transB=1); or, per channel, DequantizeLinear(q [N, K], s [N], axis=0) with no Reshape)
After::   MatMulNBits(x, packed [N, K/G, G*bits/8], s [N*K/G], K, N, bits, block_size=G)    (+ Add(b) / bias input)

A weight whose integers span more than -8..7 but at most 16 values in each block (an asymmetric 4-bit weight, its
zero points subtracted: onnxruntime's and ModelOpt's ``uint4``) is written in 4 bits with a zero point a block.
A per-channel weight (one group the size of the input) is written with blocks of up to :data:`CHANNEL_BLOCK` inputs,
the channel's scale repeated in each. ``accuracy_level`` (0: float arithmetic, exactly the QAT model's values; 4:
onnxruntime quantizes the input to int8 per block, faster on CPUs with int8 dot products, not exact) is the
converter's option. A layer whose integers are all -1, 0 or 1 (ternary: QAT at ``num_bits: 2``) is written in 2
bits; onnxruntime (1.32) computes 2-bit blocks fast only at ``accuracy_level`` 4, and at 0 dequantizes the weight
on every call (exact, many times slower than 4 bits on one token).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from ..findings import Findings
from ..ir_edits import MS_DOMAIN, Graph, Node, Value, attr, input_of
from ..qdq import QWeight, activation, weight

DEAD_CHANNELS = 16  # all-zero rows (or columns) that say a layer was pruned: the channels thinning removes at once
CHANNEL_BLOCK = 128  # a per-channel weight's block (onnxruntime's RTN default): the scale repeats in each


@dataclass(frozen=True)
class GroupedWeight:
    """A constant ``[N, K]`` weight dequantized from symmetric integers with one scale per ``group`` inputs."""

    q: np.ndarray  # [N, K] int8, zero point 0
    scale: np.ndarray  # [N, K // group] float32
    group: int
    nodes: tuple[Node, ...]  # the DequantizeLinear (and Reshape) that make it


def grouped_weight(g: Graph, value: Value | None) -> GroupedWeight | None:
    """``value`` as a grouped (or per-channel) symmetric integer weight ``[N, K]``, else None."""
    node = g.producer(value)
    reshape = node if node is not None and node.op_type == "Reshape" else None
    w = weight(g, reshape.inputs[0] if reshape is not None else value)
    if w is None or w.q.ndim != 2 or w.q.dtype != np.int8 or np.any(w.zero_point != 0):
        return None
    w = _per_channel(w, 0)
    if w.axis != 0 or w.scale.size != w.q.shape[0]:
        return None
    rows, group = w.q.shape
    if reshape is None:
        return GroupedWeight(w.q, w.scale.reshape(-1, 1).astype(np.float32), group, (w.dq,))
    shape = g.const(input_of(reshape, 1))
    if shape is None or shape.size != 2 or np.any(shape <= 0) or int(shape[0]) * int(shape[1]) != rows * group:
        return None
    n, k = (int(d) for d in shape)
    if k % group:
        return None
    return GroupedWeight(w.q.reshape(n, k), w.scale.reshape(n, k // group).astype(np.float32), group, (w.dq, reshape))


def _per_input_column(g: Graph, value: Value) -> GroupedWeight | None:
    """A ``[K, N]`` weight dequantized per output column (axis 1) as the ``[N, K]`` per-channel weight it is."""
    w = weight(g, value)
    w = _per_channel(w, 1) if w is not None and w.q.ndim == 2 else w
    if w is None or w.q.ndim != 2 or w.axis != 1 or w.q.dtype != np.int8 or np.any(w.zero_point != 0) \
            or w.scale.size != w.q.shape[1]:
        return None
    return GroupedWeight(np.ascontiguousarray(w.q.T), w.scale.reshape(-1, 1).astype(np.float32), w.q.shape[0], (w.dq,))


def _per_channel(w: QWeight, axis: int) -> QWeight:
    """``w`` with one scale for the whole tensor as the same scale for each channel along ``axis``; else as it is."""
    if w.scale.size != 1:
        return w
    return replace(w, scale=np.full(w.q.shape[axis], w.scale.reshape(-1)[0], np.float32), axis=axis)


def matmul_to_nbits(g: Graph, accuracy_level: int = 0, findings: Findings | None = None) -> int:
    """Rewrite every MatMul / Gemm of a float input by a grouped weight as ``MatMulNBits``; return how many."""
    count, dead, slow = 0, [], 0
    for node in g.each("MatMul", "Gemm"):
        x, b = node.inputs[0], input_of(node, 1)
        if activation(g, x) is not None:
            continue  # a W8A8 layer (its input quantized): the integer-op passes' to take
        if node.op_type == "Gemm":
            if attr(node, "transA", 0) or attr(node, "alpha", 1.0) != 1.0 or attr(node, "beta", 1.0) != 1.0:
                continue
            transposed = None if attr(node, "transB", 0) else g.producer(b)
        else:
            transposed = g.producer(b)
        if transposed is not None and transposed.op_type == "DequantizeLinear":
            w, transposed = _per_input_column(g, b), None  # [K, N] per channel (fold_weight_transposes' form)
        elif transposed is not None:  # the weight reaches the op as [K, N]: through a Transpose of [N, K]
            if transposed.op_type != "Transpose" or list(attr(transposed, "perm", [1, 0])) != [1, 0]:
                continue
            b = transposed.inputs[0]
            w = grouped_weight(g, b)
        else:
            w = grouped_weight(g, b)
        if w is None:
            continue
        block = _block_size(w)
        if block is None:
            if findings is not None:
                findings.kept_float[node.name] = (node.op_type, f"weight groups of {w.group} inputs: MatMulNBits "
                                                  "takes blocks of a power of two >= 16")
            continue
        bias = input_of(node, 2) if node.op_type == "Gemm" else None
        if bias is not None and (g.const(bias) is None or g.const(bias).shape not in ((w.q.shape[0],),
                                                                                      (1, w.q.shape[0]))):
            if findings is not None:  # MatMulNBits adds a bias of shape [N] alone
                findings.kept_float[node.name] = (node.op_type, "its bias is not a constant of shape [N] or [1, N] "
                                                  f"(N = {w.q.shape[0]}), the one bias MatMulNBits adds")
            continue
        if bias is not None and g.const(bias).ndim == 2:
            bias = g.add_const((bias.name or "bias") + "_vector", np.asarray(g.const(bias), np.float32).reshape(-1))
        add = _bias_add(g, node, w.q.shape[0]) if bias is None else None
        if add is not None:  # MatMul + Add(b): the bias becomes MatMulNBits' own input
            bias = next(v for v in add.inputs if g.is_const(v))
        bits = _rewrite(g, node, x, w, block, bias, accuracy_level, add)
        if findings is not None:
            dead.extend(_dead_channels(node.name, w.q))
            slow += accuracy_level == 0 and bits != 4
        for value in (b, *([transposed.outputs[0]] if transposed is not None else [])):
            producer = g.producer(value)
            if producer is not None and not g.uses(value):
                g.remove(producer)
        drop_unread(g, w)
        count += 1
    if slow:
        findings.notes.append(f"{slow} weight-only layers are MatMulNBits at 2 or 8 bits with accuracy_level 0 (float "
                              "arithmetic, exact): onnxruntime's kernels for those widths ran many times slower than "
                              "its 4-bit one, and than float, at one row on the CPUs measured (docs/pytorch.md, 'What "
                              "a layer costs in time'); time them on yours (recal_onnx.timed_candidates) or convert "
                              "with accuracy_level=4 (int8 inputs: fast, not exact)")
    if dead:
        listed = ", ".join(dead[:3]) + (f" and {len(dead) - 3} more" if len(dead) > 3 else "")
        layers = len({said.rsplit(": ", 1)[0] for said in dead})
        findings.notes.append(f"{layers} weight-only layers keep all-zero channels ({listed}), pruned most likely: "
                              "MatMulNBits still stores and computes them; thin the model before its export "
                              "(recal_torch.thin) for the smaller, faster layers")
    return count


def drop_unread(g: Graph, w: GroupedWeight) -> None:
    """Remove the nodes that made ``w`` (and their constants) once nothing reads them: a large model's float
    copy goes now, not at the end."""
    for dead in reversed(w.nodes):
        if dead.graph is g.graph and not any(g.uses(out) for out in dead.outputs):
            inputs = list(dead.inputs)
            g.remove(dead)
            g.drop_if_unused(*[v for v in inputs if v is not None])


def _bias_add(g: Graph, node: Node, n: int) -> Node | None:
    """The Add that alone reads ``node``'s output and adds a constant ``[N]`` vector to it, else None."""
    add = g.only_consumer(node.outputs[0])
    if add is None or add.op_type != "Add" or node.outputs[0].is_graph_output():
        return None
    other = add.inputs[1] if add.inputs[0] is node.outputs[0] else add.inputs[0]
    bias = g.const(other)
    return add if bias is not None and bias.shape == (n,) and bias.dtype == np.float32 else None


def _block_size(w: GroupedWeight) -> int | None:
    return nbits_block(w.q.shape[1], 0 if w.scale.shape[1] == 1 else w.group)


def nbits_block(k: int, group: int) -> int | None:
    """The ``block_size`` a weight of ``k`` inputs in groups of ``group`` (0: one scale per output channel) runs
    with in ``MatMulNBits``; None where none can (a group not a power of two from 16: the layer stays float)."""
    if not group:  # per channel: any block, the channel's scale repeated
        return max(16, min(CHANNEL_BLOCK, 1 << (k - 1).bit_length()))
    return group if group >= 16 and not group & (group - 1) else None


def _dead_channels(name: str, q: np.ndarray) -> list[str]:
    """``name: k of n outputs`` (or inputs) where a block's worth or more of its weight's rows (columns) are zero."""
    said = []
    for axis, what in ((1, "outputs"), (0, "inputs")):
        zero = int((q == 0).all(axis=axis).sum())
        if zero >= DEAD_CHANNELS:
            said.append(f"{name!r}: {zero} of {q.shape[1 - axis]} {what}")
    return said


def pack(q: np.ndarray, bits: int, block: int, zero_points: np.ndarray | None = None) -> np.ndarray:
    """``[N, K]`` signed integers as ``MatMulNBits`` stores them: ``[N, ceil(K / block), block * bits / 8]`` uint8,
    offset by the default zero point (2, 8 or 128), or by ``zero_points`` (``[N, blocks]``, one a block), 8 /
    ``bits`` values a byte (the first in the lowest bits), padding at the zero point."""
    n, k = q.shape
    blocks = -(-k // block)
    offset = np.full((n, blocks), 1 << (bits - 1), np.int16) if zero_points is None else zero_points.astype(np.int16)
    stored = np.repeat(offset, block, axis=1).astype(np.uint8)
    stored[:, :k] = (q.astype(np.int16) + np.repeat(offset, block, axis=1)[:, :k]).astype(np.uint8)
    return pack_values(stored.reshape(n, blocks, block), bits)


def pack_values(stored: np.ndarray, bits: int) -> np.ndarray:
    """Unsigned ``bits``-bit values along the last axis, 8 / ``bits`` a byte (the first in the lowest bits)."""
    per_byte = 8 // bits
    if stored.shape[-1] % per_byte:
        stored = np.concatenate([stored, np.zeros(stored.shape[:-1] + (per_byte - stored.shape[-1] % per_byte,),
                                                  np.uint8)], axis=-1)
    packed = stored[..., 0::per_byte].copy()
    for j in range(1, per_byte):
        packed |= stored[..., j::per_byte] << (bits * j)
    return np.ascontiguousarray(packed)


def block_zero_points(q: np.ndarray, block: int, bits: int = 4) -> np.ndarray | None:
    """One zero point a block (``[N, blocks]``, each within ``bits`` bits) that puts every integer of ``q`` in
    ``[0, 2**bits)``, else None: an asymmetric 4-bit weight (``uint4`` with its zero points, subtracted into int8)
    spans up to 16 values a block, not the -8..7 of the default zero point."""
    n, k = q.shape
    blocks, top = -(-k // block), (1 << bits) - 1
    padded = np.zeros((n, blocks * block), np.int16)
    padded[:, :k] = q
    rows = padded.reshape(n, blocks, block)
    low, high = rows.min(axis=2), rows.max(axis=2)
    if k % block:  # the padding is not the weight's: the last block's range is its real values'
        tail = q[:, (blocks - 1) * block:].astype(np.int16)
        low[:, -1], high[:, -1] = tail.min(axis=1), tail.max(axis=1)
    zero_points = np.clip(-low, 0, top)
    if np.any(low + zero_points < 0) or np.any(high + zero_points > top):
        return None
    return zero_points.astype(np.uint8)


def _rewrite(g: Graph, node: Node, x: Value, w: GroupedWeight, block: int, bias: Value | None,
             accuracy_level: int, add: Node | None) -> int:
    n, k = w.q.shape
    low, high = int(w.q.min()), int(w.q.max())
    bits = 2 if low >= -1 and high <= 1 else 4 if low >= -8 and high <= 7 else 8
    zero_points = block_zero_points(w.q, block) if bits == 8 else None
    bits = 4 if zero_points is not None else bits
    blocks = -(-k // block)
    per_channel = w.scale.shape[1] == 1 and w.group == k
    scale = np.repeat(w.scale, blocks, axis=1) if per_channel else w.scale  # grouped: block == group
    base = w.nodes[0].inputs[0].name
    packed = g.add_const(base + "_nbits", pack(w.q, bits, block, zero_points))
    scales = g.add_const(base + "_nbits_scales", np.ascontiguousarray(scale.reshape(-1), np.float32))
    inputs: list[Value | None] = [x, packed, scales]
    if zero_points is not None:
        inputs.append(g.add_const(base + "_nbits_zero_points", pack_values(zero_points, bits).reshape(-1)))
    if bias is not None:
        inputs += [None] * (4 - len(inputs)) + [None, bias]  # g_idx (and the zero points, if none) left out
    g.add_node("MatMulNBits", inputs, name=(node.name or "matmul") + "_nbits", domain=MS_DOMAIN,
               replaces=(add or node).outputs[0], K=k, N=n, bits=bits, block_size=block, accuracy_level=accuracy_level)
    g.remove(*([add] if add is not None else []), node)
    return bits
