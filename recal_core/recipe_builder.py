"""From parsed YAML to a :class:`~recal_core.recipe.Recipe`: the recipe's forms (a list, a mapping of modifier lists,
variables and expressions, SparseML's sparsity maps) read into modifiers, every problem located and collected."""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from . import modifiers as M
from .errors import Location, Problem, RecipeError, RecipeWarning
from .expressions import ExpressionBudget, ExpressionError, evaluate, is_expression, reported, resolve_variables
from .yaml_source import MAX_EXPANDED_CHARS, ParsedYaml, TaggedMapping, text_size

SUPPORTED_MAJOR_VERSION = 1


@dataclass(frozen=True)
class ModifierSource:
    """Where a modifier came from: the recipe list it was in, its index, its YAML node."""

    list_key: str
    index: int
    node: TaggedMapping | None

    def describe(self, tag: str) -> str:
        return f"{tag} ({self.list_key}[{self.index}])"


class RecipeBuilder:
    """Parsed YAML to ``recipe_type`` (:class:`~recal_core.recipe.Recipe`), every problem collected with where it is."""

    def __init__(self, parsed: ParsedYaml, recipe_type: type):
        self.parsed = parsed
        self.recipe_type = recipe_type
        self.source = parsed.text.source
        self.problems: list[Problem] = []

    def _where(self, key: str | None = None) -> Location:
        if key is not None and key in self.parsed.key_locations:
            return self.parsed.key_locations[key]
        return self.parsed.root_location

    def build(self):
        data = self.parsed.data
        version = "1.0.0"
        raw_variables: dict[str, Any] = {}
        lists: list[tuple[str, Any]] = []
        if isinstance(data, list):
            lists.append(("modifiers", data))
        elif isinstance(data, dict):
            stages = [k for k, v in data.items()
                      if isinstance(v, dict) and any(str(x).endswith("modifiers") for x in v)]
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
            return self.recipe_type.model_validate({"version": version, "modifiers": tuple(mods)},
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
