"""A PyTorch model as the core's channel-coupling ops and attentions: what filter, channel and head pruning rank
together and what :func:`recal_torch.thin` removes.

- :mod:`~recal_torch.tracing.model_graph`: from a ``torch.fx`` trace, or (models fx cannot trace) from
  :mod:`~recal_torch.tracing.export_graph`'s ``torch.export`` trace on example inputs, remembered from ``modify``.
- :mod:`~recal_torch.tracing.head_rows`: which rows of its projection each head of a traced attention reads.

An internal room: it declares no ``__all__``; what a user imports is :mod:`recal_torch`'s.
"""

from .export_graph import example_inputs_of, exported_graph, remember_example_inputs, trace_args
from .model_graph import model_graph, model_ops, model_spaces
