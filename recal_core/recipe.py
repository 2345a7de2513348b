"""A recipe: a version and an ordered tuple of validated modifiers, loaded once, located always.

``load_recipe`` accepts a path (YAML or Markdown with front matter) or a YAML string,
reports *every* problem at once in one :class:`~recal_core.errors.RecipeError`, and
never lets any other exception out, whatever the input.
"""

from __future__ import annotations

import math
import os
import warnings
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import yaml
from pydantic import BaseModel, ConfigDict, PrivateAttr, SerializeAsAny, ValidationError, ValidationInfo, model_validator

from . import modifiers as M
from .errors import Location, Problem, RecipeError, RecipeWarning
from .expressions import ExpressionBudget, ExpressionError, evaluate, is_expression, reported, resolve_variables
from .schedule import RecipeSchedule
from .yaml_source import MAX_EXPANDED_CHARS, ParsedYaml, TaggedMapping, parse_yaml, read_recipe_text, text_size

SUPPORTED_MAJOR_VERSION = 1


@dataclass(frozen=True)
class ModifierSource:
    """Where a modifier came from: the recipe list it was in, its index, its YAML node."""

    list_key: str
    index: int
    node: TaggedMapping | None

    def describe(self, tag: str) -> str:
        return f"{tag} ({self.list_key}[{self.index}])"


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
        return _Builder(parse_yaml(read_recipe_text(source))).build()
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


class _Builder:
    def __init__(self, parsed: ParsedYaml):
        self.parsed = parsed
        self.source = parsed.text.source
        self.problems: list[Problem] = []

    def _where(self, key: str | None = None) -> Location:
        if key is not None and key in self.parsed.key_locations:
            return self.parsed.key_locations[key]
        return self.parsed.root_location

    def build(self) -> Recipe:
        data = self.parsed.data
        version = "1.0.0"
        raw_variables: dict[str, Any] = {}
        lists: list[tuple[str, Any]] = []
        if isinstance(data, list):
            lists.append(("modifiers", data))
        elif isinstance(data, dict):
            stages = [k for k, v in data.items() if isinstance(v, dict) and any(str(x).endswith("modifiers") for x in v)]
            if stages:
                names = ", ".join(repr(str(k)) for k in stages)
                raise RecipeError(Problem(
                    self._where(stages[0]),
                    f"a staged recipe (stages {names}): SparseML's one-shot LLM format (SparseGPT, GPTQ, SmoothQuant "
                    "...), applied once to a trained model by llm-compressor's oneshot(), not during training",
                    expected="llm-compressor for this recipe; for recal, a training-time recipe: one list of "
                             "modifiers under 'modifiers' (or '*_modifiers')"))
            version = self._version(data.get("version", "1.0.0"))
            for key, value in data.items():
                if key == "version":
                    continue
                if isinstance(key, str) and key.endswith("modifiers"):
                    lists.append((key, value))
                elif _contains_tagged(value):
                    self.problems.append(Problem(
                        self._where(key), f"modifiers found under {key!r}",
                        expected="modifiers in a list under a key that ends in 'modifiers'"))
                else:
                    raw_variables[str(key)] = value
        else:
            hint = ("; if this was meant as a file path, the file does not exist"
                    if self.source == "<string>" and isinstance(data, str) else "")
            raise RecipeError(Problem(self.parsed.root_location,
                                      f"a recipe is a mapping or a list, not {type(data).__name__}{hint}",
                                      expected="'version' and 'modifiers: [...]', or a list of modifiers"))

        self.budget = ExpressionBudget()  # one for every eval() of this recipe
        self.expanded = 0  # characters of the modifiers' values once expanded
        variables, failures = resolve_variables(raw_variables, self.budget)
        for name, reason in failures.items():
            self.problems.append(Problem(self._where(name), reason, field=name))

        mods: list[M.Modifier] = []
        origins: list[ModifierSource] = []
        for key, items in lists:
            if isinstance(items, dict):
                names = ", ".join(map(str, items))
                self.problems.append(Problem(
                    self._where(key), f"untagged modifiers under {key!r} ({names}) are not supported",
                    expected="a list of tagged modifiers, e.g. '- !GradualKSModifier'"))
                continue
            if not isinstance(items, list):
                self.problems.append(Problem(self._where(key), f"{key!r} must be a list of modifiers",
                                             value=items, expected="a YAML list of '!Tag' mappings"))
                continue
            for index, item in enumerate(items):
                origin = ModifierSource(key, index, item if isinstance(item, TaggedMapping) else None)
                for mod in self._modifiers(item, origin, variables):
                    mods.append(mod)
                    origins.append(origin)
        if not mods and not self.problems:
            self.problems.append(Problem(self.parsed.root_location, "the recipe has no modifiers",
                                         expected="at least one '- !Tag' modifier under 'modifiers'"))
        if self.problems:
            raise RecipeError(self.problems)
        try:
            return Recipe.model_validate({"version": version, "modifiers": tuple(mods)},
                                         context={"source": self.source, "origins": tuple(origins)})
        except ValidationError as exc:
            raise _recipe_error(exc) from None

    def _version(self, value: Any) -> str:
        text = str(value)
        major = text.split(".")[0]
        if not major.isdigit():
            self.problems.append(Problem(self._where("version"), "invalid version", field="version",
                                         value=value, expected="a version such as 1.0.0"))
        elif int(major) != SUPPORTED_MAJOR_VERSION:
            self.problems.append(Problem(self._where("version"), f"unsupported recipe version {text}",
                                         field="version", expected=f"major version {SUPPORTED_MAJOR_VERSION}"))
        return text

    def _modifiers(self, item: Any, origin: ModifierSource, variables: dict[str, Any]) -> list[M.Modifier]:
        """The modifier (or modifiers: a sparsity -> params mapping is one per sparsity) of one YAML item."""
        return self._modifier(item, origin, variables) or []

    def _modifier(self, item: Any, origin: ModifierSource, variables: dict[str, Any]) -> list[M.Modifier] | None:
        if not isinstance(item, TaggedMapping):
            self.problems.append(Problem(
                self._where(origin.list_key), f"{origin.list_key}[{origin.index}] is not a tagged modifier",
                value=item, expected="a mapping tagged with a modifier, e.g. '- !GradualKSModifier'"))
            return None
        described = origin.describe(item.tag)
        self.problems.extend(Problem(p.location, p.message, described, p.field, expected=p.expected)
                             for p in item.problems)
        try:
            cls = M.lookup_tag(item.tag)
        except KeyError as exc:
            self.problems.append(Problem(item.location, exc.args[0], described))
            return None
        if item.fields is None:
            self.problems.append(Problem(item.location, "a modifier must be a mapping of fields", described,
                                         expected=f"fields such as {', '.join(list(cls.model_fields)[1:4])}"))
            return None
        fields: dict[str, Any] = {}
        failed = False
        for name, value in item.fields.items():
            try:
                fields[name] = _evaluate_all(value, variables, self.budget)
            except ExpressionError as exc:
                if reported(exc):
                    self.problems.append(Problem(item.field_locations.get(name, item.location), str(exc),
                                                 described, name))
                failed = True
        if failed:
            return None
        self.expanded += text_size(fields)
        if self.expanded > MAX_EXPANDED_CHARS:
            if self.expanded - text_size(fields) <= MAX_EXPANDED_CHARS:  # said once, where it happened
                self.problems.append(Problem(item.location, f"the recipe's values, with every alias and eval() "
                                             f"expanded, exceed {MAX_EXPANDED_CHARS:,} characters", described,
                                             expected="a recipe that names what it means once"))
            return None
        for name, (value, why) in cls.warned_defaults.items():
            if name not in fields:
                warnings.warn(f"{item.location}: {described}: {why}", RecipeWarning, stacklevel=2)
                fields[name] = value
        try:
            return [cls.model_validate(f) for f in _split_sparsity_map(cls, fields)]
        except ValidationError as exc:
            self._validation_problems(exc, cls, item, described)
            return None
        except ValueError as exc:
            self.problems.append(Problem(item.field_locations.get("final_sparsity", item.location), str(exc),
                                         described, "final_sparsity"))
            return None

    def _validation_problems(self, exc: ValidationError, cls: type[M.Modifier], item: TaggedMapping,
                             described: str) -> None:
        allowed = [f for f in cls.model_fields]
        for err in exc.errors(include_url=False):
            loc = err.get("loc", ())
            field = str(loc[0]) if loc else None
            where = item.field_locations.get(field, item.location) if field else item.location
            kind = err.get("type")
            if kind == "extra_forbidden":
                self.problems.append(Problem(where, "unknown field", described, field,
                                             expected="one of " + ", ".join(allowed)))
            elif kind == "missing":
                self.problems.append(Problem(item.location, f"required field '{field}' is missing",
                                             described, field))
            elif kind == "literal_error" and _unsupported_why(cls, field):
                value = item.fields.get(field)
                self.problems.append(Problem(where, f"{value!r} is not supported by recal: "
                                                    f"{_unsupported_why(cls, field)}", described, field))
            else:
                message = str(err.get("msg", "invalid")).removeprefix("Value error, ")
                inner = ".".join(str(p) for p in loc[1:])
                if inner and not isinstance(loc[-1], int):
                    message = f"{inner}: {message}"
                self.problems.append(Problem(where, message, described, field,
                                             value=item.fields.get(field) if field else None))


def _split_sparsity_map(cls: type[M.Modifier], fields: dict[str, Any]) -> list[dict[str, Any]]:
    """SparseML's ``final_sparsity: {0.9: [names], 0.95: [names]}`` (with ``params`` empty or absent): one
    pruning modifier per target sparsity, each over its names."""
    mapping = fields.get("final_sparsity")
    if not (issubclass(cls, M.GradualKSModifier) and isinstance(mapping, dict)):
        return [fields]
    if fields.get("params") not in (None, [], ()):
        raise ValueError("a sparsity -> params mapping names the params itself; leave params empty")
    if not mapping:
        raise ValueError("the sparsity -> params mapping is empty")
    return [{**fields, "final_sparsity": sparsity, "params": names} for sparsity, names in mapping.items()]


def _unsupported_why(cls: type[M.Modifier], field: str | None) -> str | None:
    """Why a field accepts only its default (its description), or None for an ordinary field."""
    info = cls.model_fields.get(field or "")
    description = (info.description or "") if info else ""
    prefix = "not supported by recal: "
    return description[len(prefix):] if description.startswith(prefix) else None


def _recipe_error(exc: ValidationError) -> RecipeError:
    """The RecipeError a model validator raised, out of pydantic's wrapper (or a plain one)."""
    for err in exc.errors(include_url=False):
        inner = (err.get("ctx") or {}).get("error")
        if isinstance(inner, RecipeError):
            return inner
    return RecipeError(str(exc))


def _contains_tagged(value: Any) -> bool:
    if isinstance(value, TaggedMapping):
        return True
    if isinstance(value, list):
        return any(_contains_tagged(v) for v in value)
    if isinstance(value, dict):
        return any(_contains_tagged(v) for v in value.values())
    return False


def _evaluate_all(value: Any, variables: dict[str, Any], budget: ExpressionBudget) -> Any:
    if is_expression(value):
        return evaluate(value, variables, budget)
    if isinstance(value, list):
        return [_evaluate_all(v, variables, budget) for v in value]
    if isinstance(value, dict):
        return {k: _evaluate_all(v, variables, budget) for k, v in value.items()}
    if isinstance(value, TaggedMapping):
        raise ExpressionError(f"a modifier ({value.tag}) cannot be used as a field value")
    return value


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
