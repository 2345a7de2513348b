"""A recipe: a version and an ordered tuple of validated modifiers, loaded once, located always.

``load_recipe`` accepts a path (YAML or Markdown with front matter) or a YAML string,
reports *every* problem at once in one :class:`~recal_core.errors.RecipeError`, and
never lets any other exception out, whatever the input.
"""

from __future__ import annotations

import math
import os
from typing import Any, Iterator, Sequence

import yaml
from pydantic import BaseModel, ConfigDict, PrivateAttr, SerializeAsAny, ValidationInfo, model_validator

from . import modifiers as M
from .errors import Location, Problem, RecipeError
from .schedule import RecipeSchedule
from .recipe_builder import ModifierSource, RecipeBuilder
from .yaml_source import parse_yaml, read_recipe_text

class Recipe(BaseModel):
    """A validated recipe. Equality compares the version and the modifiers, not where they came from.

    >>> r = load_recipe("- !EpochRangeModifier {start_epoch: 0, end_epoch: 3}")
    >>> r.max_epochs
    3
    """

    model_config = ConfigDict(frozen=True)

    version: str = "1.0.0"
    modifiers: tuple[SerializeAsAny[M.Modifier], ...]
    _source: str = PrivateAttr(default="<recipe>")
    _origins: tuple[ModifierSource | None, ...] = PrivateAttr(default=())

    @model_validator(mode="after")
    def _across_modifiers(self, info: ValidationInfo) -> "Recipe":
        """Rules that involve several modifiers: checked however the recipe is built.

        :func:`load_recipe` passes where each modifier came from in the validation context, so
        the problems are located; a ``Recipe(...)`` built in code gets them without lines.
        """
        context = info.context or {}
        self._source = context.get("source", self._source)
        self._origins = tuple(context.get("origins", self._origins))
        _check_across_modifiers(self)
        return self

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Recipe):
            return NotImplemented
        return self.version == other.version and self.modifiers == other.modifiers

    __hash__ = None  # type: ignore[assignment]

    # --- where things are ---------------------------------------------------------------

    @property
    def source(self) -> str:
        return self._source

    def describe(self, index: int) -> str:
        """``!GradualKSModifier (modifiers[2])``: how errors name a modifier.

        Args:
            index: the modifier's position in the recipe's flattened modifier list."""
        mod = self.modifiers[index]
        origin = self._origins[index] if index < len(self._origins) else None
        return origin.describe(mod.yaml_tag) if origin else f"{mod.yaml_tag} (modifier #{index})"

    def location(self, index: int, field: str | None = None) -> Location:
        """Where modifier ``index`` (or its ``field``) is written: file, line and path, for error messages.

        Args:
            index: the modifier's position in the recipe's flattened modifier list.
            field: one of its fields, or None for the modifier itself."""
        origin = self._origins[index] if index < len(self._origins) else None
        if origin is None or origin.node is None:
            return Location(self._source)
        if field is not None and field in origin.node.field_locations:
            return origin.node.field_locations[field]
        return origin.node.location

    def problem(self, index: int, field: str | None, message: str, *, value: Any = None,
                expected: str | None = None) -> Problem:
        """A :class:`Problem` located at ``field`` of modifier ``index`` (used by the backends).

        Args:
            index: the modifier's position in the recipe's flattened modifier list.
            field: the field at fault, or None for the whole modifier.
            message: what is wrong.
            value: the offending value, shown (escaped) in the message.
            expected: what would be accepted instead."""
        extra = {} if value is None else {"value": value}
        return Problem(self.location(index, field), message, self.describe(index), field,
                       expected=expected, **extra)

    # --- derived facts --------------------------------------------------------------------

    def of_type(self, cls: type[M.Modifier] | tuple[type[M.Modifier], ...]) -> Iterator[tuple[int, Any]]:
        """(index, modifier) pairs of the given type(s), in recipe order."""
        return ((i, m) for i, m in enumerate(self.modifiers) if isinstance(m, cls))

    @property
    def max_epochs_exact(self) -> float:
        """The last epoch any modifier mentions (EpochRangeModifier end, any end, start, milestone); without an
        EpochRangeModifier, one epoch more where a modifier starts there and never ends (a quantization-only recipe
        from epoch 0: else ``range(max_epochs)`` would train nothing and QAT never run)."""
        last = max(_epoch_marks(self.modifiers), default=0.0)
        if any(isinstance(m, M.EpochRangeModifier) for m in self.modifiers):
            return last
        for m in self.modifiers:
            start, end = getattr(m, "start_epoch", None), getattr(m, "end_epoch", None)
            if start is not None and max(start, 0.0) >= last - 1e-9 and (end is None or end < 0):
                return last + 1.0
        return last

    @property
    def max_epochs(self) -> int:
        """Number of epochs to train: ``ceil`` of :attr:`max_epochs_exact` (an int, for ``range``)."""
        return int(math.ceil(self.max_epochs_exact - 1e-9))

    @property
    def min_epochs(self) -> int:
        """The first epoch any modifier starts at (``-1`` starts count as 0)."""
        starts = [max(getattr(m, "start_epoch", 0.0), 0.0) for m in self.modifiers]
        return int(math.floor(min(starts, default=0.0)))

    def bind(self, steps_per_epoch: int) -> RecipeSchedule:
        """Turn epochs into steps: the :class:`~recal_core.schedule.RecipeSchedule` every backend queries.

        Args:
            steps_per_epoch: optimizer steps per epoch of the training loop (a positive integer)."""
        return RecipeSchedule(self, steps_per_epoch)

    # --- writing --------------------------------------------------------------------------

    def to_yaml(self) -> str:
        """YAML that :func:`load_recipe` reads back to an equal recipe (canonical tags, defaults left out)."""
        doc = {"version": self.version, "modifiers": list(self.modifiers)}
        return yaml.dump(doc, Dumper=_RecipeDumper, sort_keys=False, default_flow_style=None)


def _epoch_marks(modifiers: Sequence[M.Modifier]) -> Iterator[float]:
    for m in modifiers:
        for name in ("start_epoch", "end_epoch", "freeze_bn_stats_epoch", "disable_quantization_observer_epoch"):
            value = getattr(m, name, None)
            if value is not None and value >= 0:
                yield value


class _RecipeDumper(yaml.SafeDumper):
    """SafeDumper subclass that writes modifiers with their tag; PyYAML's dumper is untouched."""


def _represent_modifier(dumper: yaml.SafeDumper, mod: M.Modifier) -> yaml.Node:
    return dumper.represent_mapping(mod.yaml_tag, mod.model_dump(mode="json", exclude_defaults=True))


for _cls in M.MODIFIER_TYPES:
    _RecipeDumper.add_representer(_cls, _represent_modifier)


# --- loading ------------------------------------------------------------------------------


def load_recipe(source: str | os.PathLike | Recipe) -> Recipe:
    """Load and validate a recipe from a path, a YAML/Markdown string, or return a Recipe as is.

    Args:
        source: a ``.yaml`` / ``.md`` file's path, the recipe's text itself, or a :class:`Recipe`.

    Returns:
        The validated, immutable recipe.

    Raises:
        RecipeError: listing every problem at once (file, line, column, modifier, field, what was expected).
    """
    if isinstance(source, Recipe):
        return source
    if not isinstance(source, (str, os.PathLike)):
        raise TypeError(f"load_recipe takes a path or a YAML string, not {type(source).__name__}")
    try:
        return RecipeBuilder(parse_yaml(read_recipe_text(source)), Recipe).build()
    except RecipeError:
        raise
    except RecursionError:
        raise RecipeError(Problem(Location(_source_name(source)), "the recipe contains a structure that "
                                  "contains itself (a recursive alias)", expected="plain nested data")) from None
    except MemoryError:
        raise RecipeError(Problem(Location(_source_name(source)), "out of memory while reading the recipe",
                                  expected="a recipe within recal's limits (see the README's reliability section)"))
    except Exception as exc:  # the loader's contract: RecipeError for any input
        raise RecipeError(Problem(
            Location(_source_name(source)),
            f"internal error while reading the recipe ({type(exc).__name__}: {exc}); please report it")) from exc


def _source_name(source: str | os.PathLike) -> str:
    if isinstance(source, os.PathLike):
        return str(source)
    return "<string>" if "\n" in source or not os.path.exists(source) else source


def _check_across_modifiers(recipe: Recipe) -> None:
    """Rules that involve several modifiers; every violation is reported."""
    problems: list[Problem] = []
    whole_model_qat = [i for i, m in recipe.of_type(M.QuantizationModifier) if m.submodules is None]
    if len(whole_model_qat) > 1:
        for i in whole_model_qat[1:]:
            problems.append(recipe.problem(i, None, "a second QuantizationModifier over the whole model",
                                           expected="one QuantizationModifier, or give each its own submodules"))
    horizon = recipe.max_epochs_exact
    for i, m in recipe.of_type(M.LearningRateModifier):
        if m.lr_class == "MultiStepLR" and m.end_epoch == -1:
            late = [x for x in m.lr_kwargs["milestones"] if x >= horizon]
            if late:
                problems.append(recipe.problem(i, "lr_kwargs", f"milestones {late} fall after training ends",
                                               expected=f"milestones before epoch {horizon:g}"))
    if problems:
        raise RecipeError(problems)


def recipe_json_schema() -> dict[str, Any]:
    """A JSON Schema (draft 2020-12) of the recipe format, for editors (``recal schema``).

    YAML tags are not part of JSON Schema: each modifier mapping is validated against the
    union of the modifier shapes; editors should declare the tags as custom tags.
    """
    defs: dict[str, Any] = {}
    variants = []
    for cls in M.MODIFIER_TYPES:
        schema = cls.model_json_schema(ref_template="#/$defs/{model}")
        defs.update(schema.pop("$defs", {}))
        schema["title"] = "!" + cls.tag
        schema["description"] = (cls.__doc__ or "").strip().splitlines()[0]
        defs[cls.tag] = schema
        variants.append({"$ref": f"#/$defs/{cls.tag}"})
    modifier_list = {"type": "array", "items": {"anyOf": variants}}
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": "recal recipe",
        "description": "A version and lists of modifiers under keys ending in 'modifiers'. "
                       "Each modifier is a YAML mapping tagged with its name, e.g. !GradualKSModifier.",
        "oneOf": [
            {"type": "object",
             "properties": {"version": {"type": ["string", "number"]}, "modifiers": modifier_list},
             "patternProperties": {".*modifiers$": modifier_list}},
            modifier_list,
        ],
        "$defs": defs,
    }
