"""What a conversion gives back: the model, where it was written, and what was done to it and why."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import onnx

from .targets import DEFAULT_TARGET
from .verify import Verification


@dataclass
class ConversionResult:
    model: onnx.ModelProto
    path: Path | None
    rewrites: dict[str, int] = field(default_factory=dict)
    unconverted: list[tuple[str, str]] = field(default_factory=list)  # (op type, node name)
    verification: Verification | None = None
    seconds: float = 0.0
    float_ops: dict[str, int] = field(default_factory=dict)  # op type -> nodes that compute in float (by design too)
    weight_type: str = "int8"  # "uint8": some layers' weights (beyond +-64) written as uint8, zero point 128
    target: str = DEFAULT_TARGET  # the CPUs the model is for (recal_onnx.targets)
    weights_note: str = ""  # which weight form was written, and why, in one sentence
    # node name -> how far (in int32 steps, <= 0.5) its float bias was from the grid the int8 layer holds it on
    rounded_biases: dict[str, float] = field(default_factory=dict)
    # node name -> its largest bias in int32 steps, where beyond 2^24 (no float32 bias lies on that grid)
    coarse_biases: dict[str, float] = field(default_factory=dict)
    # node name (op type and position where it has none) of each node left float -> why, in one clause
    float_reasons: dict[str, str] = field(default_factory=dict)
    # attention (its Softmax's name) -> why its zero heads stay: the converter cannot follow its layout
    heads_kept: dict[str, str] = field(default_factory=dict)
    # Where node name -> the softmax mask constant (Swin's -100) made -10000 (recal_onnx.passes.masks_to_exact_zeros)
    masked_scores: dict[str, float] = field(default_factory=dict)
    # node name -> the largest |q| of its float weight, read as int8 (recal_onnx.passes.weights_from_grids)
    grid_weights: dict[str, int] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)  # what the conversion changed in the model as a whole
    # target any, weights beyond +-64: the twin for x86 without VNNI (uint8 weights there), and where it was written
    avx2_model: onnx.ModelProto | None = None
    avx2_path: Path | None = None

    @property
    def rounded_biases_note(self) -> str:
        """What rounding another exporter's float biases means, in one clause ('' when none were rounded)."""
        if not self.rounded_biases:
            return ""
        note = (f"{len(self.rounded_biases)} float biases lay between the int32 steps their int8 layers hold (up to "
                f"{max(self.rounded_biases.values()):.2f} step) and were rounded: values near a rounding boundary can "
                "differ by one step from the QAT model (recal's exporters write biases on the grid)")
        if self.coarse_biases:
            note += (f"; {len(self.coarse_biases)} of them are beyond 2^24 steps (up to "
                     f"{max(self.coarse_biases.values()):.3g}), where no float32 bias lies on the grid: those layers' "
                     "inputs are nearly dead (a tiny input scale), in the QAT model itself: check its initialisation "
                     "or training")
        return note

    @property
    def masked_scores_note(self) -> str:
        """What changing softmax masks means, in one clause ('' when none was changed)."""
        if not self.masked_scores:
            return ""
        values = ", ".join(f"{v:g}" for v in sorted(set(self.masked_scores.values())))
        return (f"{len(self.masked_scores)} softmax masks of {values} now mask with -10000: the probabilities they "
                "left (float32 denormals, slow on Intel CPUs) are exactly 0, a change below float32's resolution of "
                "the outputs (result.masked_scores names them)")

    @property
    def grid_weights_note(self) -> str:
        """What reading float weights on int8 grids means, in one clause ('' when none was)."""
        return (f"{len(self.grid_weights)} layers' float weights lie on int8 grids (their quantization folded into "
                "floats, as tf2onnx writes a TF QAT model's) and were read as those integers, the same values "
                "(result.grid_weights names them)") if self.grid_weights else ""

    @property
    def float_nodes(self) -> list[tuple[str, str]]:
        """The ops left in float between a DequantizeLinear and a QuantizeLinear: ``(op type, node name)``."""
        return self.unconverted
