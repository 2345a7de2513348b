"""The training modifiers: distillation, trainable parameters, weight decay, and the epoch range."""

from __future__ import annotations

from typing import Annotated, ClassVar, Literal

from pydantic import (Field, StrictBool, StrictFloat, field_validator)

from .modifier_base import (Epoch,
                            Modifier, NonNegativeNumber, ParamGroups, ParamSpec, PositiveNumber,
                            _unsupported)


class EpochRangeModifier(Modifier):
    """The range of training epochs (``max_epochs`` comes from it and every other modifier)."""

    tag: ClassVar[str] = "EpochRangeModifier"
    start_sentinel: ClassVar[bool] = False
    end_sentinel: ClassVar[bool] = False
    start_epoch: Epoch
    end_epoch: Epoch


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
