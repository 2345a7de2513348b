"""A layer left float because int32 cannot hold its bias adds that bias in an Add of its own.

Before::  DQ(x), DQ(w) -> Conv(bias) -> Q
After::   DQ(x), DQ(w) -> Conv -> Add(bias reshaped [1, C, 1, 1]) -> Q

:func:`~recal_onnx.quantized_ops.quantized_bias` refuses such a bias (it is never clipped) and records the layer in
``g.kept_float``. Left whole, ``DQ -> Conv(bias) -> Q`` is what onnxruntime fuses into an integer conv itself,
quantizing the bias to the int32 that cannot hold it (measured: 1.1 where the model computes 5.0); apart,
the conv and the Add stay float, exact.
"""

from __future__ import annotations

from ..graph import Graph


def bias_apart(g: Graph) -> int:
    count = 0
    for node in [n for n in g.nodes if n.name in g.kept_float]:
        if node.op_type not in ("Conv", "Gemm") or len(node.input) < 3 or not node.input[2]:
            continue
        bias = g.const(node.input[2])
        if bias is None:
            continue
        rank = g.ranks.get(node.output[0], 4 if node.op_type == "Conv" else 2)
        shape = [1, -1] + [1] * (rank - 2) if node.op_type == "Conv" else bias.shape  # Gemm's C broadcasts as is
        summed, node.output[0] = node.output[0], g.fresh(node.output[0] + "_no_bias")
        g.add_node("Add", [node.output[0], g.add_const(node.input[2] + "_apart", bias.reshape(shape))], [summed],
                   name=node.name + "_bias")
        del node.input[2]
        count += 1
    if count:
        g.refresh()
    return count
