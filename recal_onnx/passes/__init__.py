"""Graph rewrite passes; each takes a :class:`~recal_onnx.graph.Graph` and returns how many rewrites it made."""
