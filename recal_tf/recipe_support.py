"""What both TensorFlow front ends accept from a recipe: the features only recal_torch runs are refused the same
way, one warning class, one limit on the per-step tables they build."""

from __future__ import annotations

from recal_core import modifiers as M
from recal_core.errors import Problem
from recal_core.model_plan import is_second_order
from recal_core.schedule import RecipeSchedule

MAX_TABLE_STEPS = 10_000_000  # the graph holds per-step tables (mask update ids, LR, weight decay)
MAX_TABLE_ENTRIES = 20_000_000  # all of them together: steps x tables, about 200 MB at most


class RecalWarning(UserWarning):
    """A recipe feature is set up in a way that will not have its effect."""


def per_step_tables(schedule: RecipeSchedule) -> int:
    """How many per-step tables a TensorFlow front end builds for ``schedule``."""
    lr = 1 if schedule.controls_lr else 0
    decay = 1 if any(True for _ in schedule.recipe.of_type(M.SetWeightDecayModifier)) else 0
    return 2 * len(schedule.pruning) + 3 * len(schedule.quantization) + lr + decay


def check_table_size(schedule: RecipeSchedule, where: str) -> None:
    """Refuse, before any table is built, a schedule whose per-step tables would exceed recal's limits
    (:data:`MAX_TABLE_STEPS` steps, :data:`MAX_TABLE_ENTRIES` entries in all); ``where`` names the front end."""
    steps, tables = schedule.total_steps, per_step_tables(schedule)
    if steps > MAX_TABLE_STEPS or (steps + 1) * tables > MAX_TABLE_ENTRIES:
        raise ValueError(
            f"the recipe runs {steps:,} steps ({schedule.recipe.max_epochs} epochs x {schedule.steps_per_epoch:,}) "
            f"with {tables} per-step tables; {where} tabulates per-step values in the graph and takes at most "
            f"{MAX_TABLE_STEPS:,} steps and {MAX_TABLE_ENTRIES:,} entries in all: use fewer steps per epoch or "
            "fewer modifiers, or run the recipe with recal_torch, which computes them step by step")


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


def qat_problems(schedule: RecipeSchedule, where: str) -> list[Problem]:
    """A second QuantizationModifier, and the fields that pick what to quantize (TensorFlow quantizes every
    conv and dense/matmul it can): one located problem each."""
    recipe = schedule.recipe
    problems = []
    for n, (index, m) in enumerate(schedule.quantization):
        if n:
            problems.append(recipe.problem(index, None, "a second QuantizationModifier",
                                           expected=f"one QuantizationModifier per recipe {where}"))
        if m.base_scheme.learned is not None:
            problems.append(recipe.problem(
                index, "scheme", f"learned scales (observer: lsq) are not available {where} yet",
                expected="observer: minmax (or run this recipe with recal_torch)"))
        elif m.base_scheme != M.SCHEME_PRESETS["W8A8"]:
            problems.append(recipe.problem(
                index, "scheme", f"scheme {m.scheme if isinstance(m.scheme, str) else 'other than W8A8'} is not "
                "available " + where + " yet: weights int8 per channel, activations uint8",
                expected="no scheme, or W8A8 (weight-only and 4-bit schemes: run this recipe with recal_torch)"))
        for field in ("submodules", "ignore", "scheme_overrides"):
            if getattr(m, field):
                problems.append(recipe.problem(
                    index, field, f"{field} is not available {where} yet: every conv and dense layer is quantized",
                    value=getattr(m, field), expected=f"no {field} (or run this recipe with recal_torch)"))
    return problems
