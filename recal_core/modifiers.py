"""Every recipe modifier as a frozen, validated pydantic model, and the one tag registry.

The models are data: they hold what the recipe says and check it once, at load. What a modifier *does* at step
``k`` is computed by :mod:`recal_core.schedule` from these fields; masks, hooks and graph ops live in the backends.
The shared base and field types are in :mod:`recal_core.modifier_base`, the LR modifiers in
:mod:`recal_core.lr_modifiers`; this module gathers them all under one name.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import (BaseModel, ConfigDict, Field, StrictBool, StrictFloat, ValidationInfo, field_validator,
                      model_validator)

from .lr_modifiers import LearningRateFunctionModifier, LearningRateModifier, SetLearningRateModifier
from .mask_layout import max_sparsity, normalise_mask_type
# re-exported: the backends and the core read M.ALL, M.Epoch and the rest from this one module
from .modifier_base import (_NUMBER, ALL, ALL_PRUNABLE, INTER_FUNCS, LR_CLASSES, MAX_EPOCH, Epoch,  # noqa: F401
                            Modifier, NonNegativeNumber, Number, ParamGroups, ParamSpec, PositiveNumber,
                            _check_params, _unsupported, check_patterns)


class EpochRangeModifier(Modifier):
    """The range of training epochs (``max_epochs`` comes from it and every other modifier)."""

    tag: ClassVar[str] = "EpochRangeModifier"
    start_sentinel: ClassVar[bool] = False
    end_sentinel: ClassVar[bool] = False
    start_epoch: Epoch
    end_epoch: Epoch


class GradualKSModifier(Modifier):
    """Gradual magnitude pruning from ``init_sparsity`` to ``final_sparsity`` (SparseML: GMPruningModifier)."""

    tag: ClassVar[str] = "GradualKSModifier"
    aliases: ClassVar[tuple[str, ...]] = ("GMPruningModifier",)
    start_sentinel: ClassVar[bool] = False
    end_sentinel: ClassVar[bool] = False
    params: ParamSpec
    init_sparsity: Number
    final_sparsity: Number
    start_epoch: Epoch
    end_epoch: Epoch
    update_frequency: Epoch
    inter_func: Literal["linear", "cubic", "inverse_cubic"] = "cubic"
    leave_enabled: StrictBool = True
    global_sparsity: StrictBool = False  # true: one magnitude ranking across every named layer
    mask_type: Any = Field("unstructured", description="unstructured, filter, channel, head, [a, b] blocks or 'N:M'")
    phased: Literal[False] = _unsupported(False, "phased pruning is not implemented")
    score_type: Literal["magnitude"] = _unsupported("magnitude", "pruning scores are weight magnitudes")

    @field_validator("final_sparsity", mode="before")
    @classmethod
    def _no_sparsity_map(cls, v: Any) -> Any:
        if isinstance(v, dict):
            raise ValueError("a mapping of sparsity -> params is read by load_recipe (one modifier per "
                             "sparsity); a GradualKSModifier built in code takes one final_sparsity")
        return v

    @field_validator("init_sparsity", "final_sparsity")
    @classmethod
    def _sparsity(cls, v: float, info: ValidationInfo) -> float:
        if not 0.0 <= v < 1.0:
            raise ValueError(f"{info.field_name} must be in [0, 1)")
        init = info.data.get("init_sparsity")
        if info.field_name == "final_sparsity" and init is not None and v < init:
            raise ValueError(f"final_sparsity ({v:g}) must be >= init_sparsity ({init:g})")
        return v

    @field_validator("update_frequency")
    @classmethod
    def _frequency(cls, v: float) -> float:
        if v != -1 and v <= 0:
            raise ValueError("update_frequency must be > 0 epochs, or -1 to update every step")
        return v

    @field_validator("mask_type")
    @classmethod
    def _mask_type(cls, v: Any, info: ValidationInfo) -> Any:
        kind = normalise_mask_type(v)
        if kind != "unstructured" and info.data.get("global_sparsity"):
            raise ValueError(f"global_sparsity ranks single weights across layers; mask_type {kind!r} is per layer")
        final = info.data.get("final_sparsity")
        if final is not None and final > max_sparsity(kind) + 1e-12:
            raise ValueError(f"mask_type {kind!r} keeps at most {1 - max_sparsity(kind):g} of the weights; "
                             f"final_sparsity {final:g} is beyond its {max_sparsity(kind):g}")
        return kind


class GlobalMagnitudePruningModifier(GradualKSModifier):
    """GradualKS with one magnitude ranking across every named layer (SparseML's modifier of that name)."""

    tag: ClassVar[str] = "GlobalMagnitudePruningModifier"
    aliases: ClassVar[tuple[str, ...]] = ()
    global_sparsity: Literal[True] = _unsupported(True, "this modifier is global (use GradualKSModifier per layer)")


class OBSPruningModifier(GradualKSModifier):
    """The Optimal BERT Surgeon (Kurtic et al., 2022): GradualKS whose pruned weights are the least salient
    under an empirical, block-diagonal Fisher of the last ``num_grads`` training gradients
    (``w^2 / (2 [F^-1]_ii)``, or ``w_Q^T ([F^-1]_QQ)^-1 w_Q / 2`` for a block ``Q``), and whose kept
    weights take the OBS update that compensates for them. PyTorch."""

    tag: ClassVar[str] = "OBSPruningModifier"
    aliases: ClassVar[tuple[str, ...]] = ()
    num_grads: Annotated[int, Field(strict=True, ge=1, le=100_000)] = 64
    fisher_block_size: Annotated[int, Field(strict=True, ge=1, le=4096)] = 50
    damp: PositiveNumber = 1e-7
    grad_sampler_kwargs: dict[str, Any] | None = Field(
        None, description="SparseML's sampler settings; recal takes the gradients of the training steps")
    num_recomputations: Literal[1] = _unsupported(1, "one OBS step per update (leave num_recomputations out)")

    @field_validator("mask_type")
    @classmethod
    def _mask_type(cls, v: Any, info: ValidationInfo) -> Any:
        kind = normalise_mask_type(v)
        if kind not in ("unstructured", (1, 4)):
            raise ValueError(f"OBS prunes single weights or blocks of 4 (block4), not {kind!r}")
        return kind

    @field_validator("fisher_block_size")
    @classmethod
    def _block(cls, v: int, info: ValidationInfo) -> int:
        if info.data.get("mask_type") == (1, 4) and v % 4:
            raise ValueError(f"fisher_block_size {v} must be a multiple of the mask's block of 4")
        return v


class MFACPruningModifier(GradualKSModifier):
    """M-FAC pruning (Frantar, Kurtic and Alistarh, 2021): GradualKS whose pruned weights are the least
    salient, ``w_i^2 / (2 [F^-1]_ii)``, under the damped empirical Fisher of the last ``num_grads`` training
    gradients in blocks of ``fisher_block_size``, applied matrix-free (memory: ``num_grads`` values per
    weight, never a block squared); the kept weights take the joint OBS update, also matrix-free.
    PyTorch."""

    tag: ClassVar[str] = "MFACPruningModifier"
    aliases: ClassVar[tuple[str, ...]] = ()
    num_grads: Annotated[int, Field(strict=True, ge=1, le=4096)] = 64
    fisher_block_size: Annotated[int, Field(strict=True, ge=1, le=1_000_000)] = 2000
    damp: PositiveNumber = 1e-5
    available_gpus: tuple[str, ...] | None = Field(
        None, description="SparseML's devices for the Fisher; recal keeps it on the parameters' device")
    mask_type: Literal["unstructured"] = _unsupported("unstructured", "M-FAC prunes single weights")


class ACDCPruningModifier(Modifier):
    """AC/DC: alternating compressed (a magnitude mask at ``compression_sparsity``) and decompressed (dense)
    phases of ``update_frequency`` epochs over ``[start_epoch, end_epoch)``, the last one compressed."""

    tag: ClassVar[str] = "ACDCPruningModifier"
    start_sentinel: ClassVar[bool] = False
    end_sentinel: ClassVar[bool] = False
    params: ParamSpec
    compression_sparsity: Annotated[StrictFloat, Field(ge=0, lt=1)]
    start_epoch: Epoch
    end_epoch: Epoch
    update_frequency: Annotated[StrictFloat, Field(gt=0, le=MAX_EPOCH)]
    global_sparsity: StrictBool = False
    leave_enabled: StrictBool = True
    mask_type: Literal["unstructured"] = _unsupported("unstructured", "AC/DC masks single weights")


class ConstantKSModifier(Modifier):
    """Keep the existing zeros of already-pruned parameters (SparseML: ConstantPruningModifier)."""

    tag: ClassVar[str] = "ConstantKSModifier"
    aliases: ClassVar[tuple[str, ...]] = ("ConstantPruningModifier",)
    params: ParamSpec
    start_epoch: Epoch = -1.0
    end_epoch: Epoch = -1.0


class QuantizationArgs(BaseModel):
    """How one tensor is quantized (SparseML's / compressed-tensors' ``QuantizationArgs``).

    recal quantizes activations to 8 bits, and weights to 8 bits or, weight-only (``input_activations: null``), to
    4 or 2 (ternary: -1, 0, 1); ``strategy: group`` gives every ``group_size`` consecutive inputs of an output channel their own scale."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    num_bits: Annotated[int, Field(strict=True)] = 8
    symmetric: StrictBool = True
    strategy: Literal["tensor", "channel", "group"] | None = None
    group_size: Annotated[int, Field(strict=True)] | None = None
    observer: Literal["minmax", "mse", "lsq"] = Field(
        "minmax", description="how a weight's scale is chosen: its largest magnitude (minmax), the clipping of it "
                              "that quantizes the weight with the least squared error (mse; weight-only layers), or "
                              "learned by gradient descent (lsq, LSQ's scaled gradient; PyTorch, and Keras / TF for W8A8; "
                              "from the mse fit for weight-only layers, from minmax for W8A8 weights and inputs)")
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


class DistillationModifier(Modifier):
    """Knowledge distillation from a teacher model over ``[start_epoch, end_epoch)``: the training loss
    becomes ``hardness * KD + (1 - hardness) * loss``, KD the temperature-softened KL divergence of the
    student's outputs (those under ``distill_output_keys``) from the teacher's, times ``temperature**2``."""

    tag: ClassVar[str] = "DistillationModifier"
    start_epoch: Epoch = -1.0
    end_epoch: Epoch = -1.0
    hardness: Annotated[StrictFloat, Field(ge=0, le=1)] = 0.5
    temperature: PositiveNumber = 2.0
    distill_output_keys: tuple[str, ...] | None = None
    update_frequency: Literal[-1.0] = _unsupported(-1.0, "distillation applies to every step")

    @field_validator("distill_output_keys")
    @classmethod
    def _keys(cls, v: tuple[str, ...] | None) -> tuple[str, ...] | None:
        if v is not None and (not v or any(not k.strip() for k in v) or len(set(v)) != len(v)):
            raise ValueError("distill_output_keys must be a non-empty list of distinct output names")
        return v


class TrainableParamsModifier(Modifier):
    """Mark ``params`` trainable (or frozen) over ``[start_epoch, end_epoch)``; restored at the end."""

    tag: ClassVar[str] = "TrainableParamsModifier"
    params: ParamSpec
    trainable: StrictBool = True
    params_strict: Literal[True] = _unsupported(True, "a params entry that matches nothing is always an error")
    start_epoch: Epoch = -1.0
    end_epoch: Epoch = -1.0


class SetWeightDecayModifier(Modifier):
    """Set the optimizer's weight decay from ``start_epoch`` (-1: from the first step).

    ``param_groups`` (optimizer param-group indices) names the groups to set; by default every
    group whose weight decay was not 0 when the recipe was applied (groups a user keeps free of
    decay, such as biases and norms, stay so).
    """

    tag: ClassVar[str] = "SetWeightDecayModifier"
    start_epoch: Epoch = -1.0
    weight_decay: NonNegativeNumber
    param_groups: ParamGroups = None
    end_epoch: Literal[-1.0] = _unsupported(-1.0, "the weight decay holds until another SetWeightDecayModifier starts")
    constant_logging: StrictBool = False



# --- registry ----------------------------------------------------------------------------

MODIFIER_TYPES: tuple[type[Modifier], ...] = (
    EpochRangeModifier, GradualKSModifier, GlobalMagnitudePruningModifier, OBSPruningModifier, MFACPruningModifier,
    ACDCPruningModifier,
    ConstantKSModifier, QuantizationModifier,
    SetLearningRateModifier, LearningRateModifier, LearningRateFunctionModifier, TrainableParamsModifier,
    SetWeightDecayModifier, DistillationModifier,
)
REGISTRY: dict[str, type[Modifier]] = {}
for _cls in MODIFIER_TYPES:
    for _name in (_cls.tag, *_cls.aliases):
        REGISTRY[_name] = _cls

FRAMEWORK_PREFIXES = ("pytorch.", "tensorflow.", "tensorflow_v1.", "keras.")

# SparseML modifiers recal knows of but does not implement, with what to do instead.
NOT_SUPPORTED: dict[str, str] = {
    "MagnitudePruningModifier": "use GradualKSModifier",
    "MovementPruningModifier": "movement pruning is not implemented; use GradualKSModifier",
    "LayerPruningModifier": "layer removal is not implemented",
    "LegacyQuantizationModifier": "use QuantizationModifier",
    "SparseGPTModifier": "one-shot SparseGPT is not implemented",
    "GPTQModifier": "one-shot GPTQ is not implemented",
    "SmoothQuantModifier": "SmoothQuant is not implemented",
}


def lookup_tag(tag: str) -> type[Modifier]:
    """Return the modifier class for a YAML tag (``!GMPruningModifier``, ``!pytorch.X`` ...).

    Raises ``KeyError`` with a message that lists the known tags.
    """
    name = tag[1:] if tag.startswith("!") else tag
    for prefix in FRAMEWORK_PREFIXES:
        if name.startswith(prefix):
            name = name[len(prefix):]
            break
    if name in REGISTRY:
        return REGISTRY[name]
    if name in NOT_SUPPORTED:
        raise KeyError(f"{name} is a SparseML modifier that recal does not support: {NOT_SUPPORTED[name]}")
    known = ", ".join("!" + n for n in REGISTRY)
    raise KeyError(f"unknown modifier tag {tag!r}; known tags: {known}")
