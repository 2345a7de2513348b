"""Graph rewrite passes; each takes a :class:`~recal_onnx.graph.Graph` (an ``onnx_ir`` model) and returns how many
rewrites it made."""

__all__: list[str] = []  # internal: the pipeline (recal_onnx.pipeline) runs them in its declared order
