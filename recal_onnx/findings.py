"""What the converter's passes find beyond their rewrites: the record a conversion reports from.

One :class:`Findings` is made per conversion and handed to the passes that add to it (or read it); the graph
holds only the model being rewritten.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class Findings:
    """The passes' record of one conversion."""

    # node name -> (op type, why a pass left it float): bias_apart gives each its bias in an Add of its own
    kept_float: dict[str, tuple[str, str]] = field(default_factory=dict)
    # softmax node name -> why thin_heads left that attention's (zero, most likely pruned) heads in place
    heads_kept: dict[str, str] = field(default_factory=dict)
    # tensor name -> the channels (axis 1) thin_channels kept: verification compares only those
    thinned: dict[str, np.ndarray] = field(default_factory=dict)
    # node name -> how far (in int32 steps, <= 0.5) its float bias was from the grid its int8 layer holds it on
    rounded_biases: dict[str, float] = field(default_factory=dict)
    # quantized layer output tensor -> the most its rounded bias moves it, in its own steps (verification allows a
    # differing value that much further from a rounding boundary, and no more)
    bias_moves: dict[str, float] = field(default_factory=dict)
    # node name -> its largest bias in int32 steps, where that passes 2^24: a float32 bias cannot lie on so fine a grid
    # (the layer's input scale is tiny: a near-dead activation)
    coarse_biases: dict[str, float] = field(default_factory=dict)
    # Where node name -> the mask constant (-10000 < c <= -64) masks_to_exact_zeros made -10000: its probabilities 0
    masked_scores: dict[str, float] = field(default_factory=dict)
    # node name -> the largest |q| of its float weight, read back as int8 (weights_from_grids: a folded quantization)
    grid_weights: dict[str, int] = field(default_factory=dict)
    # integer pool output tensor -> the share of its window sums whose mean is an exact tie (pool_to_qlinear):
    # onnxruntime's pools round those otherwise than the QDQ model, whose own float noise decides them; verification
    # counts that many of its differing values apart
    tied_pools: dict[str, float] = field(default_factory=dict)
    # what a pass changed in the model as a whole, one clause each (float16 computing in float32)
    notes: list[str] = field(default_factory=list)
