"""The recipe features only recal_torch runs, refused the same way by both TensorFlow front ends."""

from __future__ import annotations

from recal_core.errors import Problem
from recal_core.model_plan import is_second_order
from recal_core.schedule import RecipeSchedule


def torch_only_problems(schedule: RecipeSchedule, where: str) -> list[Problem]:
    """One located problem per second-order pruning or distillation modifier; ``where`` names the front end
    ("in the TensorFlow graph API", "for Keras")."""
    recipe = schedule.recipe
    problems = []
    for ps in schedule.pruning:
        if is_second_order(ps):
            tag = ps.modifier.tag
            problems.append(recipe.problem(ps.index, None, f"second-order pruning ({tag}) is not available {where}",
                                           expected=f"run this recipe's {tag} with recal_torch, or use GradualKSModifier"))
    for index, _, _ in schedule.distillation:
        problems.append(recipe.problem(index, None, f"knowledge distillation is not available {where}",
                                       expected="run this recipe's DistillationModifier with recal_torch, or remove it"))
    return problems
