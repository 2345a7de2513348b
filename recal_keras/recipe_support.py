"""What both TensorFlow front ends accept from a recipe: the features only recal_torch runs are refused the same
way (said with :class:`~recal_keras.errors.RecalWarning`), one limit on the per-step tables they build."""

from __future__ import annotations

from recal_core import modifiers as M
from recal_core.errors import Problem
from recal_core.model_plan import is_second_order
from recal_core.schedule import RecipeSchedule

MAX_TABLE_STEPS = 10_000_000  # the graph holds per-step tables (mask update ids, LR, weight decay)
MAX_TABLE_ENTRIES = 20_000_000  # all of them together: steps x tables, about 200 MB at most


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
            problems.append(recipe.problem(
                ps.index, None, f"second-order pruning ({tag}) is not available {where}",
                expected=f"run this recipe's {tag} with recal_torch, or use GradualKSModifier"))
    for index, _, _ in schedule.distillation:
        problems.append(recipe.problem(
            index, None, f"knowledge distillation is not available {where}",
            expected="run this recipe's DistillationModifier with recal_torch, or remove it"))
    return problems


def _observed(args: M.QuantizationArgs | None) -> M.QuantizationArgs | None:
    return None if args is None else args.model_copy(update={"observer": "minmax", "observer_kwargs": None})


def learned_scales(m: M.QuantizationModifier) -> tuple[bool, bool]:
    """Whether ``m``'s weights and its layers' input activations learn their scales (``observer: lsq``)."""
    learned = m.base_scheme.learned or (None, None)
    return learned[0] is not None, learned[1] is not None


def qat_problems(schedule: RecipeSchedule, where: str, learns: bool = False) -> list[Problem]:
    """A second QuantizationModifier, and the fields that pick what to quantize (TensorFlow quantizes every
    conv and dense/matmul it can): one located problem each. ``learns``: the front end learns scales
    (``observer: lsq`` on weights and input activations), with one learning rate for every variable."""
    recipe = schedule.recipe
    problems = []
    for n, (index, m) in enumerate(schedule.quantization):
        if n:
            problems.append(recipe.problem(index, None, "a second QuantizationModifier",
                                           expected=f"one QuantizationModifier per recipe {where}"))
        scheme = m.base_scheme
        if scheme.learned is not None and not learns:
            problems.append(recipe.problem(
                index, "scheme", f"learned scales (observer: lsq) are not available {where} yet",
                expected="observer: minmax (or run this recipe with recal_torch)"))
        elif scheme.learned is not None:
            for args in filter(None, scheme.learned):
                if args.lr_factor != 1.0 or args.calibration_steps != 1:
                    problems.append(recipe.problem(
                        index, "scheme", f"observer_kwargs {args.observer_kwargs} {where}: the optimizer takes "
                        "one learning rate for every variable, and a learned scale starts from the first QAT "
                        "step's range", expected="observer: lsq without lr_factor or calibration_steps (or run "
                        "this recipe with recal_torch)"))
            plain = scheme.model_copy(update={"weights": _observed(scheme.weights),
                                              "input_activations": _observed(scheme.input_activations)})
            if plain != M.SCHEME_PRESETS["W8A8"]:
                problems.append(recipe.problem(
                    index, "scheme", f"learned scales {where} on a scheme other than W8A8", expected="W8A8's "
                    "tensors (int8 per-channel weights, uint8 input activations) with observer: lsq"))
        elif scheme != M.SCHEME_PRESETS["W8A8"]:
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
