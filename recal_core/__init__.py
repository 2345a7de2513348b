"""recal_core: the framework-neutral recipe: loading, validation, schedules, parameter matching.

Imports no ML framework; both backends call these functions and re-derive nothing.
"""

from .errors import Location, Problem, RecipeError
from .modifiers import (
    ConstantKSModifier,
    DistillationModifier,
    EpochRangeModifier,
    GradualKSModifier,
    LearningRateFunctionModifier,
    LearningRateModifier,
    Modifier,
    QuantizationModifier,
    SetLearningRateModifier,
    SetWeightDecayModifier,
    TrainableParamsModifier,
)
from .recipe import Recipe, load_recipe, recipe_json_schema

__all__ = [
    "ConstantKSModifier", "DistillationModifier", "EpochRangeModifier", "GradualKSModifier", "LearningRateFunctionModifier", "LearningRateModifier",
    "Location", "Modifier", "Problem", "QuantizationModifier", "Recipe", "RecipeError",
    "SetLearningRateModifier", "SetWeightDecayModifier", "TrainableParamsModifier",
    "load_recipe", "recipe_json_schema",
]
