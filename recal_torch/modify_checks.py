"""What ``modify`` checks of a recipe against the model before anything changes: second-order curvature within its
memory limit, and the SparseML fields recal accepts but does not use (each said, with why)."""

from __future__ import annotations

import os
import warnings

from recal_core import modifiers as M
from recal_core.errors import Problem, RecipeWarning
from recal_core.model_plan import ModelPlan
from recal_core.recipe import Recipe
from recal_core.schedule import RecipeSchedule

# OBS / M-FAC curvature above this is refused at modify(), before any allocation
MAX_CURVATURE_BYTES = int(float(os.environ.get("RECAL_MAX_CURVATURE_GB", "8")) * 2**30)
UNUSED_FIELDS = {"grad_sampler_kwargs": "recal takes the gradients of the num_grads training steps before each update",
                 "available_gpus": "recal keeps the Fisher on the device of the parameters it prunes"}


def curvature_problems(recipe: Recipe, plan: ModelPlan) -> list[Problem]:
    """A problem for each OBS / M-FAC modifier whose curvature would exceed :data:`MAX_CURVATURE_BYTES`.

    Args:
        recipe: the recipe, to locate each problem.
        plan: the model's plan, which sizes each modifier's curvature.
    """
    problems = []
    for ps, size in plan.curvature_bytes():
        if size > MAX_CURVATURE_BYTES:
            field = "num_grads" if isinstance(ps.modifier, M.MFACPruningModifier) else "fisher_block_size"
            problems.append(recipe.problem(
                ps.index, field, f"its curvature would hold {size / 2**20:,.1f} MiB for "
                f"{len(plan.prune_targets[ps.index])} layers (the limit is {MAX_CURVATURE_BYTES / 2**20:,.1f} "
                "MiB; set RECAL_MAX_CURVATURE_GB to raise it)",
                expected=f"a smaller {field}, or fewer layers in params"))
    return problems


def warn_unused_fields(recipe: Recipe, schedule: RecipeSchedule) -> None:
    """A warning for each pruning modifier's field recal accepts but does not use, naming where and why.

    Args:
        recipe: the recipe, to locate each field.
        schedule: the recipe bound to the run, whose pruning modifiers are checked.
    """
    for ps in schedule.pruning:
        for field, why in UNUSED_FIELDS.items():
            if getattr(ps.modifier, field, None):
                warnings.warn(f"{recipe.location(ps.index, field)}: {recipe.describe(ps.index)}: {field} is not used: "
                              f"{why}", RecipeWarning, stacklevel=3)
