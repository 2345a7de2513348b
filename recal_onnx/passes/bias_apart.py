"""A layer left float because int32 cannot hold its bias adds that bias in an Add of its own.

Before::  DQ(x), DQ(w) -> Conv(bias) -> Q
After::   DQ(x), DQ(w) -> Conv -> Add(bias reshaped [1, C, 1, 1]) -> Q

:func:`~recal_onnx.quantized_ops.quantized_bias` refuses such a bias (it is never clipped) and records the layer in
``findings.kept_float``. Left whole, ``DQ -> Conv(bias) -> Q`` is what onnxruntime fuses into an integer conv itself,
quantizing the bias to the int32 that cannot hold it (measured: 1.1 where the model computes 5.0); apart,
the conv and the Add stay float, exact.
"""

from __future__ import annotations

from ..findings import Findings
from ..ir_edits import Graph, input_of


def bias_apart(g: Graph, findings: Findings | None = None) -> int:
    count = 0
    kept = {} if findings is None else findings.kept_float
    for node in [n for n in g.nodes if n.name in kept]:
        if node.op_type not in ("Conv", "Gemm") or input_of(node, 2) is None:
            continue
        bias = g.const(node.inputs[2])
        if bias is None:
            continue
        rank = g.rank(node.outputs[0]) or (4 if node.op_type == "Conv" else 2)
        shape = [1, -1] + [1] * (rank - 2) if node.op_type == "Conv" else bias.shape  # Gemm's C broadcasts as is
        out = node.outputs[0]
        add = g.add_node("Add", [None, g.add_const(node.inputs[2].name + "_apart", bias.reshape(shape))],
                         name=node.name + "_bias", replaces=out)
        out.name = g.fresh(add.outputs[0].name + "_no_bias")
        add.replace_input_with(0, out)
        node.resize_inputs(2)
        count += 1
    return count
