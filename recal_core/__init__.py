"""recal_core: the framework-neutral recipe: loading, validation, schedules, parameter matching.

Imports no ML framework; both backends call these functions and re-derive nothing.
"""

from . import precision_plan
from .atomic import atomic_path, write_text_atomically
from .datasets import load_digits
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
    "atomic_path", "load_digits", "load_recipe", "precision_plan", "recipe_json_schema", "write_text_atomically",
]
