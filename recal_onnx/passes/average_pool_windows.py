"""Average pools whose windows pass the input's edge (``ceil_mode``) written so that onnxruntime's integer kernel
means what its float kernel does.

Hugging Face's EfficientNet pools its last feature map with ``nn.AvgPool2d(hidden_dim, ceil_mode=True)``: a
2560x2560 window over a 2x2 (or 7x7) map, exported as ``AveragePool(ceil_mode=1, count_include_pad=1, pads=0)``.
onnxruntime's float ``AveragePool`` averages the values inside the input (what the QAT model means); its QDQ fusion
of the same pool into ``QLinearAveragePool`` divides by the whole window when ``count_include_pad`` is set, so a model
that keeps it, in a default session, feeds the classifier its zero point (measured: transformers' EfficientNet-b0
classifier off by 78 steps, its bias alone; a 64x64 window over 2x2: every output 0 instead of the mean). With no
explicit pads ``count_include_pad`` changes nothing in the float kernel, so it is cleared: both kernels then average
the values inside the input. Where the input's spatial size is known and the window covers it whole, the pool is
the ``GlobalAveragePool`` it means (an exact integer kernel, any batch).

Before::  x -> AveragePool(kernel, ceil_mode=1, count_include_pad=1, pads=0)
After::   x -> AveragePool(kernel, ceil_mode=1, count_include_pad=0, pads=0)   (or GlobalAveragePool: one window)
"""

from __future__ import annotations

from ..ir_edits import Graph, attr, set_attr


def average_pool_windows(g: Graph) -> int:
    count = 0
    for node in g.each("AveragePool"):
        kernel = list(attr(node, "kernel_shape", []) or [])
        pads = list(attr(node, "pads", []) or [])
        auto_pad = attr(node, "auto_pad", "NOTSET")
        auto_pad = auto_pad.decode() if isinstance(auto_pad, bytes) else auto_pad
        if any(pads) or auto_pad not in ("NOTSET", "VALID") or any(d != 1 for d in (attr(node, "dilations", []) or [])):
            continue  # explicit pads: count_include_pad means something
        if _one_window(node, kernel) and not node.outputs[0].is_graph_output():
            g.add_node("GlobalAveragePool", [node.inputs[0]], name=node.name + "_global", replaces=node.outputs[0])
            g.remove(node)
            count += 1
        elif attr(node, "count_include_pad", 0) and attr(node, "ceil_mode", 0):
            set_attr(node, "count_include_pad", 0)
            count += 1
    return count


def _one_window(node, kernel: list[int]) -> bool:
    """Whether the pool's input has a known spatial size that its window covers in one position per axis."""
    shape = node.inputs[0].shape if node.inputs and node.inputs[0] is not None else None
    if shape is None or len(shape) != len(kernel) + 2:
        return False
    spatial = list(shape)[2:]
    if not all(isinstance(d, int) for d in spatial):
        return False
    strides = list(attr(node, "strides", []) or [1] * len(kernel))
    ceil = bool(attr(node, "ceil_mode", 0))
    # the window is the input, or passes it (ceil_mode) by less than a stride
    return all(k == n or (ceil and n < k < n + s) for k, n, s in zip(kernel, spatial, strides))
