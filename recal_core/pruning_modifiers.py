"""The pruning modifiers: gradual (magnitude, global magnitude, OBS, M-FAC), AC/DC, and constant sparsity."""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import (Field, StrictBool, StrictFloat, ValidationInfo, field_validator)

from .mask_layout import max_sparsity, normalise_mask_type
from .modifier_base import (MAX_EPOCH, Epoch,
                            Modifier, Number, ParamSpec, PositiveNumber,
                            _unsupported)


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
