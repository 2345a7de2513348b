"""A sigmoid of a quantized tensor whose output is quantized: QLinearSigmoid (com.microsoft).

Before::  q -> DequantizeLinear(s, zp) -> Sigmoid -> QuantizeLinear(s2, zp2) -> q2
After::   q -> QLinearSigmoid(s, zp, s2, zp2) -> q2

onnxruntime builds a 256-entry table from the same float sigmoid of each input value and looks the integers up:
about 5x faster than the float form on a feature map (0.17 vs 0.91 ms on 1x96x56x56, one thread), and the same
numbers. recal's QAT quantizes a sigmoid's output (squeeze-excitation's gate, a SiLU's sigmoid) for this.
"""

from __future__ import annotations

from ..ir_edits import MS_DOMAIN, Graph
from ..qdq import activation, quantize_node_of
from ..quantized_ops import replace_with_quantized


def sigmoid_to_qlinear(g: Graph) -> int:
    count = 0
    for node in g.each("Sigmoid"):
        x, q = activation(g, node.inputs[0]), quantize_node_of(g, node.outputs[0])
        if x is None or q is None:
            continue
        replace_with_quantized(g, [node], None, q, "QLinearSigmoid", [x.q, x.scale, x.zero_point, *q.inputs[1:3]],
                               name=node.name + "_quant", domain=MS_DOMAIN)
        count += 1
    return count
