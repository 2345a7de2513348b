"""Every recipe modifier as a frozen, validated pydantic model, and the one tag registry.

The models are data: they hold what the recipe says and check it once, at load. What a modifier *does* at step
``k`` is computed by :mod:`recal_core.schedule` from these fields; masks, hooks and graph ops live in the backends.
Each family has its module (:mod:`~recal_core.pruning_modifiers`, :mod:`~recal_core.quantization_modifiers`,
:mod:`~recal_core.training_modifiers`, :mod:`~recal_core.lr_modifiers`; the shared base and field types:
:mod:`~recal_core.modifier_base`); this module gathers them under one name and holds the tag registry.
"""

from __future__ import annotations

# re-exported: the backends and the core read M.ALL, M.Epoch, M.QuantizationArgs and the rest from this one module
from .lr_modifiers import LearningRateFunctionModifier, LearningRateModifier, SetLearningRateModifier
from .modifier_base import (_NUMBER, ALL, ALL_PRUNABLE, INTER_FUNCS, LR_CLASSES, MAX_EPOCH, Epoch,  # noqa: F401
                            Modifier, NonNegativeNumber, Number, ParamGroups, ParamSpec, PositiveNumber,
                            _check_params, _unsupported, check_patterns)
from .pruning_modifiers import (ACDCPruningModifier, ConstantKSModifier, GlobalMagnitudePruningModifier,
                                GradualKSModifier, MFACPruningModifier, OBSPruningModifier)
from .quantization_modifiers import (REDUCED_WEIGHT_LEVELS, SCHEME_PRESETS, WEIGHT_LEVELS, WEIGHT_ONLY_LEVELS,  # noqa: F401
                                     QuantizationArgs, QuantizationModifier, QuantizationScheme)
from .training_modifiers import (DistillationModifier, EpochRangeModifier, SetWeightDecayModifier,
                                 TrainableParamsModifier)

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
