"""Graph rewrite passes; each takes a :class:`~recal_onnx.graph.Graph` (an ``onnx_ir`` model) and returns how many
rewrites it made."""
