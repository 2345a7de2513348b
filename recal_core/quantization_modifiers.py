"""The quantization modifier and its arguments: which layers, which grids, observers, when it starts and freezes."""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import (BaseModel, ConfigDict, Field, StrictBool, ValidationInfo, field_validator,
                      model_validator)

from .modifier_base import (Epoch,
                            Modifier, _unsupported, check_patterns)


class QuantizationArgs(BaseModel):
    """How one tensor is quantized (SparseML's / compressed-tensors' ``QuantizationArgs``).

    recal quantizes activations to 8 bits, and weights to 8 bits or, weight-only (``input_activations: null``), to
    4 or 2 (ternary: -1, 0, 1); ``strategy: group`` gives every ``group_size`` consecutive inputs of an output channel
    their own scale."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    num_bits: Annotated[int, Field(strict=True)] = 8
    symmetric: StrictBool = True
    strategy: Literal["tensor", "channel", "group"] | None = None
    group_size: Annotated[int, Field(strict=True)] | None = None
    observer: Literal["minmax", "mse", "lsq"] = Field(
        "minmax", description="how a weight's scale is chosen: its largest magnitude (minmax), the clipping of it "
                              "that quantizes the weight with the least squared error (mse; weight-only layers), or "
                              "learned by gradient descent (lsq, LSQ's scaled gradient; PyTorch, and Keras / TF for "
                              "W8A8; from the mse fit for weight-only layers, from minmax for W8A8 weights and "
                              "inputs)")
    observer_kwargs: dict[str, float] | None = Field(
        None, description="lsq: {lr_factor: f}, the scales' learning rate as a multiple of the first param group's "
                          "(default 1.0); input activations also {calibration_steps: n}, the range averaged over "
                          "the first n training batches as the start (default 1)")
    type: Literal["int"] = _unsupported("int", "recal quantizes to integers")

    @field_validator("num_bits")
    @classmethod
    def _bits(cls, v: int) -> int:
        if v not in (2, 4, 8):
            raise ValueError(f"recal quantizes to 8 bits (or weight-only weights to 4 or 2), not {v}")
        return v

    @field_validator("group_size")
    @classmethod
    def _group_size(cls, v: int | None) -> int | None:
        if v is not None and (v < 16 or v & (v - 1)):
            raise ValueError(f"group_size must be a power of two >= 16 (onnxruntime's MatMulNBits block sizes), "
                             f"not {v}")
        return v

    @model_validator(mode="before")
    @classmethod
    def _bare_group_size(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("group_size") is not None and data.get("strategy") is None:
            data = {**data, "strategy": "group"}  # compressed-tensors' reading of a bare group_size
        return data

    @field_validator("observer_kwargs")
    @classmethod
    def _observer_kwargs(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        if v is None:
            return v
        unknown = sorted(set(v) - {"lr_factor", "calibration_steps"})
        if unknown:
            raise ValueError(f"observer_kwargs takes lr_factor, calibration_steps, not {', '.join(map(repr, unknown))}")
        factor = v.get("lr_factor", 1.0)
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not 0 < factor < float("inf"):
            raise ValueError(f"lr_factor must be a positive number, not {factor!r}")
        steps = v.get("calibration_steps", 1)
        if isinstance(steps, bool) or steps != int(steps) or not 1 <= steps <= 100_000:
            raise ValueError(f"calibration_steps must be a whole number of steps from 1 to 100,000, not {steps!r}")
        return v

    @property
    def lr_factor(self) -> float:
        """lsq: the scales' learning rate over the first param group's."""
        return float((self.observer_kwargs or {}).get("lr_factor", 1.0))

    @property
    def calibration_steps(self) -> int:
        """lsq input activations: the training batches whose ranges, averaged, start the scale."""
        return int((self.observer_kwargs or {}).get("calibration_steps", 1))

    @model_validator(mode="after")
    def _group(self) -> "QuantizationArgs":
        if self.observer_kwargs is not None and self.observer != "lsq":
            raise ValueError(f"observer_kwargs go with observer: lsq, not {self.observer}")
        if self.group_size is not None and self.strategy != "group":
            raise ValueError(f"group_size goes with strategy: group, not strategy: {self.strategy}")
        if self.strategy == "group" and self.group_size is None:
            raise ValueError("strategy: group needs a group_size (e.g. 32 or 128)")
        return self


WEIGHT_LEVELS = 127  # int8 symmetric weights: |q| <= 127
# reduce_range: |q| <= 64, so |q1| + |q2| <= 128 and x86's vpmaddubsw (uint8 x int8 pairs summed in int16) never
# saturates: 255 * 128 = 32640 <= 32767
REDUCED_WEIGHT_LEVELS = 64
WEIGHT_ONLY_LEVELS = {8: WEIGHT_LEVELS, 4: 7, 2: 1}  # |q| <= levels, stored + 2**(bits-1) by MatMulNBits


class QuantizationScheme(BaseModel):
    """A ``scheme`` / ``scheme_overrides`` entry: ``null`` leaves that tensor float. Unnamed entries take SparseML's
    defaults (asymmetric inputs, symmetric weights, no output quantization)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    input_activations: QuantizationArgs | None = QuantizationArgs(symmetric=False)
    weights: QuantizationArgs | None = QuantizationArgs(symmetric=True)
    output_activations: QuantizationArgs | None = None

    @model_validator(mode="after")
    def _calibrated_inputs_only(self) -> "QuantizationScheme":
        if self.weights is not None and "calibration_steps" in (self.weights.observer_kwargs or {}):
            raise ValueError("calibration_steps goes with input_activations (a weight's learned scale starts from "
                             "the weight itself)")
        return self

    @property
    def leaves_float(self) -> bool:
        return self.input_activations is None and self.weights is None and self.output_activations is None

    @property
    def weight_only(self) -> bool:
        """Weights quantized, activations float (W4A16, W8A16): the layer multiplies float inputs by weights
        dequantized from integers (onnxruntime's MatMulNBits)."""
        return self.weights is not None and self.input_activations is None and self.output_activations is None

    @property
    def learned(self) -> tuple[QuantizationArgs | None, QuantizationArgs | None] | None:
        """For a W8A8 layer whose weights or input activations have ``observer: lsq``: the args of each that
        learns its scale (None: that one observes); None when neither learns."""
        args = tuple(x if x is not None and x.observer == "lsq" else None
                     for x in (self.weights, self.input_activations))
        return None if self.weight_only or args == (None, None) else args

    @property
    def weights_not_per_channel(self) -> bool:
        """Quantized weights other than recal's int8 symmetric per channel (per row, for a table)."""
        w = self.weights
        return w is not None and (not w.symmetric or w.strategy in ("tensor", "group") or w.num_bits != 8)

    def conflicts_with_recal(self) -> list[str]:
        """What this scheme asks of a Conv/Linear that recal's QAT does not do: uint8 asymmetric activations
        with int8 symmetric per-channel weights, all three quantized together; or weight-only (activations float)
        symmetric weights of 8 or 4 bits, per channel or per group."""
        if self.weight_only:
            return [] if self.weights.symmetric and self.weights.strategy != "tensor" else [
                "weight-only weights other than symmetric per channel or per group"]
        out = []
        if any(a is not None and a.observer == "mse" for a in (self.input_activations, self.weights,
                                                                self.output_activations)):
            out.append("an mse observer outside weight-only layers")
        if self.output_activations is not None and self.output_activations.observer == "lsq":
            out.append("an lsq observer on output activations (input activations and weights learn theirs)")
        if not self.leaves_float and (self.input_activations is None or self.weights is None):
            out.append("a layer with some tensors float and others quantized (list the layer in ignore "
                       "to leave it float)")
        if self.weights_not_per_channel:
            out.append("weights other than int8 symmetric per channel with quantized activations (2- or 4-bit or "
                       "per-group weights are weight-only: input_activations: null)")
        for act in (self.input_activations, self.output_activations):
            if act is not None and (act.symmetric or act.strategy in ("channel", "group") or act.num_bits != 8):
                out.append("activations other than 8-bit asymmetric per tensor")
                break
        return out

    def table_conflicts_with_recal(self) -> list[str]:
        """What this scheme asks of an embedding table that recal's QAT does not do: tables are symmetric, 8 or 4
        bits, per row or per group of a row (ids are integers and the rows the table returns float)."""
        w = self.weights
        return ["embedding tables other than symmetric 8 or 4 bits per row or per group"] if (
            w is not None and (not w.symmetric or w.strategy == "tensor" or w.num_bits == 2)) else []

    @property
    def table_is_int8_per_row(self) -> bool:
        """An int8 symmetric per-row (minmax) table: recal's default QATEmbedding."""
        w = self.weights
        return w is not None and w.num_bits == 8 and w.strategy in (None, "channel") and w.observer == "minmax"


# compressed-tensors' preset names (llm-compressor's ``scheme: W4A16``): what each asks of every Conv/Linear
SCHEME_PRESETS: dict[str, QuantizationScheme] = {
    "W8A8": QuantizationScheme(),
    "W8A16": QuantizationScheme(input_activations=None, weights=QuantizationArgs(num_bits=8, strategy="channel")),
    "W4A16": QuantizationScheme(input_activations=None,
                                weights=QuantizationArgs(num_bits=4, strategy="group", group_size=128)),
}


class QuantizationModifier(Modifier):
    """Quantization-aware training from ``start_epoch`` on; it cannot be switched off."""

    tag: ClassVar[str] = "QuantizationModifier"
    warned_defaults: ClassVar[dict[str, tuple[Any, str]]] = {
        "start_epoch": (-1.0, "no start_epoch: QAT runs from the first step (start_epoch: -1), as SparseML 1.x ran "
                              "it; write start_epoch to say when")}
    start_epoch: Epoch
    submodules: tuple[str, ...] | None = None
    ignore: tuple[str, ...] | None = Field(
        None, description="module names, class names or re: patterns of module names to leave float")
    scheme: QuantizationScheme | Literal["W8A8", "W8A16", "W4A16"] | None = Field(
        None, description="how every Conv/Linear is quantized: a preset (W8A8, the default; W8A16 and W4A16 "
                          "weight-only, W4A16 in groups of 128) or a scheme; scheme_overrides refine it")
    scheme_overrides: dict[str, QuantizationScheme] | None = Field(
        None, description="per module class or name, how its tensors are quantized (null: float)")
    freeze_bn_stats_epoch: Epoch | None = None
    disable_quantization_observer_epoch: Epoch | None = None
    reduce_range: StrictBool = Field(
        False, description="7-bit weights (|q| <= 64): exact in the int8 kernels of every x86 CPU, with or without "
                           "VNNI (SparseML's field; activations stay 8-bit)")
    end_epoch: Literal[-1.0] = _unsupported(-1.0, "quantization cannot be disabled once started (leave end_epoch out)")

    @property
    def base_scheme(self) -> QuantizationScheme:
        """The scheme every Conv/Linear takes unless ``scheme_overrides`` names it (the preset's, if one)."""
        if isinstance(self.scheme, str):
            return SCHEME_PRESETS[self.scheme]
        return self.scheme or SCHEME_PRESETS["W8A8"]

    @property
    def weight_levels(self) -> int:
        """The largest integer a quantized conv / dense weight takes: 64 with ``reduce_range``, else 127."""
        return REDUCED_WEIGHT_LEVELS if self.reduce_range else WEIGHT_LEVELS

    @field_validator("submodules", "ignore")
    @classmethod
    def _names(cls, v: tuple[str, ...] | None, info: ValidationInfo) -> tuple[str, ...] | None:
        if v is not None and (not v or any(not s.strip() for s in v)):
            raise ValueError(f"{info.field_name} must be a non-empty list of module names")
        return v

    @field_validator("ignore", "scheme_overrides")
    @classmethod
    def _patterns(cls, v):
        check_patterns(v or ())
        return v

    @field_validator("freeze_bn_stats_epoch", "disable_quantization_observer_epoch")
    @classmethod
    def _after_start(cls, v: float | None, info: ValidationInfo) -> float | None:
        start = info.data.get("start_epoch")
        if v is not None and start is not None and v < max(start, 0.0):
            raise ValueError(f"{info.field_name} ({v:g}) must be >= start_epoch ({start:g})")
        return v
