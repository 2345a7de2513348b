"""recal_core: the framework-neutral recipe: loading, validation, schedules, parameter matching.

Imports no ML framework; both backends call these functions and re-derive nothing.
"""

from .errors import Location, Problem, RecipeError
from .modifiers import (
    ACDCPruningModifier,
    ConstantKSModifier,
    DistillationModifier,
    EpochRangeModifier,
    GlobalMagnitudePruningModifier,
    GradualKSModifier,
    LearningRateFunctionModifier,
    LearningRateModifier,
    MFACPruningModifier,
    Modifier,
    OBSPruningModifier,
    QuantizationModifier,
    SetLearningRateModifier,
    SetWeightDecayModifier,
    TrainableParamsModifier,
)
from .recipe import Recipe, load_recipe, recipe_json_schema

__all__ = [
    "ACDCPruningModifier", "ConstantKSModifier", "DistillationModifier", "EpochRangeModifier",
    "GlobalMagnitudePruningModifier", "GradualKSModifier", "LearningRateFunctionModifier", "LearningRateModifier",
    "Location", "MFACPruningModifier", "Modifier", "OBSPruningModifier", "Problem", "QuantizationModifier", "Recipe",
    "RecipeError",
    "SetLearningRateModifier", "SetWeightDecayModifier", "TrainableParamsModifier",
    "load_recipe", "recipe_json_schema",
]
