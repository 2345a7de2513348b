"""Reading recipe text: Markdown front matter, a private safe YAML loader, node positions.

Only tags that start with ``!`` (the recipe's own modifier tags) construct anything,
and what they construct is plain data (:class:`TaggedMapping`) that remembers the line
and column of every field, so that later validation can point at the exact spot.
PyYAML's global loaders are never modified.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from .errors import Location, Problem, RecipeError


@dataclass
class TaggedMapping:
    """A ``!Tag`` node from the YAML: the tag, its fields and where each one is."""

    tag: str
    fields: dict[str, Any] | None  # None when the tagged node is not a mapping
    location: Location
    field_locations: dict[str, Location] = field(default_factory=dict)
    problems: list[Problem] = field(default_factory=list)


@dataclass
class RecipeText:
    """Recipe YAML ready to parse: the text, its source name and its line offset in the file."""

    yaml: str
    source: str
    line_offset: int = 0

    def location(self, mark: yaml.Mark | None) -> Location:
        if mark is None:
            return Location(self.source)
        return Location(self.source, mark.line + 1 + self.line_offset, mark.column + 1)


# YAML 1.1 (PyYAML) reads ``8e-5`` as a string; recipes mean a float (YAML 1.2 does too).
_FLOAT_WITHOUT_DOT = re.compile(r"^[-+]?[0-9][0-9_]*[eE][-+]?[0-9]+$")


class _RecipeLoader(yaml.SafeLoader):
    """SafeLoader subclass: recipe tags, scientific floats, and a source for positions.

    ``add_constructor`` / ``add_implicit_resolver`` copy the class tables on first use
    in a subclass, so ``yaml.SafeLoader`` itself stays untouched.
    """

    recipe_text: RecipeText


def _construct_tagged(loader: _RecipeLoader, tag_suffix: str, node: yaml.Node) -> TaggedMapping:
    text = loader.recipe_text
    tag = "!" + tag_suffix
    where = text.location(node.start_mark)
    if not isinstance(node, yaml.MappingNode):
        return TaggedMapping(tag, None, where)
    loader.flatten_mapping(node)
    fields: dict[str, Any] = {}
    locations: dict[str, Location] = {}
    problems: list[Problem] = []
    for key_node, value_node in node.value:
        key = loader.construct_object(key_node, deep=True)
        key_where = text.location(key_node.start_mark)
        if not isinstance(key, str):
            problems.append(Problem(key_where, "field names must be strings", tag, value=key))
            continue
        if key in fields:
            problems.append(
                Problem(key_where, "field given twice", tag, key,
                        expected=f"one value (first at line {locations[key].line})")
            )
            continue
        fields[key] = loader.construct_object(value_node, deep=True)
        locations[key] = text.location(value_node.start_mark)
    return TaggedMapping(tag, fields, where, locations, problems)


_RecipeLoader.add_multi_constructor("!", _construct_tagged)
_RecipeLoader.add_implicit_resolver("tag:yaml.org,2002:float", _FLOAT_WITHOUT_DOT, list("-+0123456789"))


@dataclass
class ParsedYaml:
    """The document as Python data, plus the position of every top-level key."""

    data: Any
    text: RecipeText
    root_location: Location
    key_locations: dict[str, Location]


def parse_yaml(text: RecipeText) -> ParsedYaml:
    """Parse one YAML document; any YAML error becomes a located :class:`RecipeError`."""
    try:
        loader = _RecipeLoader(text.yaml)
    except yaml.reader.ReaderError as exc:
        raise RecipeError(Problem(Location(text.source), f"invalid character in the recipe: {exc.reason}",
                                  value=chr(exc.character) if isinstance(exc.character, int) else exc.character,
                                  expected="printable text")) from None
    loader.recipe_text = text
    try:
        node = loader.get_single_node()
        if node is None:
            raise RecipeError(Problem(Location(text.source, 1 + text.line_offset, 1),
                                      "the recipe is empty", expected="a YAML mapping or list of modifiers"))
        key_locations: dict[str, Location] = {}
        if isinstance(node, yaml.MappingNode):
            for key_node, _ in node.value:
                if isinstance(key_node, yaml.ScalarNode):
                    key_locations.setdefault(str(key_node.value), text.location(key_node.start_mark))
        data = loader.construct_document(node)
        return ParsedYaml(data, text, text.location(node.start_mark), key_locations)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        reason = " ".join(s for s in (exc.context, exc.problem) if s) or "invalid YAML"
        raise RecipeError(Problem(text.location(mark), f"YAML error: {reason}")) from None
    except yaml.YAMLError as exc:  # e.g. a reader error for bad characters
        raise RecipeError(Problem(Location(text.source), f"YAML error: {' '.join(str(exc).split())}")) from None
    except RecursionError:
        raise RecipeError(Problem(Location(text.source), "YAML nesting too deep")) from None
    finally:
        loader.dispose()


_HTML_COMMENT = re.compile(r"\A\s*<!--.*?-->", re.DOTALL)
_FENCE = re.compile(r"^---[ \t]*$", re.MULTILINE)


def split_front_matter(text: str, source: str, markdown: bool | None = None) -> RecipeText:
    """Return the YAML part of ``text``: the front matter of a Markdown file, or all of it.

    Markdown front matter is the block between the first two ``---`` lines; an HTML
    comment (a licence header, say) may come before it. ``markdown=None`` guesses: text
    that opens with an HTML comment, or with ``---`` and closes the block later, is
    Markdown.
    """
    body_start = 0
    comment = _HTML_COMMENT.match(text)
    if comment:
        body_start = comment.end()
    fences = list(_FENCE.finditer(text, body_start))
    rest_before = text[body_start: fences[0].start()] if fences else ""
    opens_with_fence = bool(fences) and rest_before.strip() == ""
    if markdown is None:
        markdown = bool(comment) or (opens_with_fence and len(fences) >= 2)
    if not markdown:
        return RecipeText(text, source)
    if not opens_with_fence or len(fences) < 2:
        raise RecipeError(Problem(
            Location(source, 1, 1), "no YAML front matter found",
            expected="the recipe between two '---' lines at the top of the Markdown file"))
    start = fences[0].end() + 1  # the line after the opening '---'
    return RecipeText(text[start: fences[1].start()], source, text.count("\n", 0, start))


def read_recipe_text(source: str | os.PathLike) -> RecipeText:
    """Read a recipe from a path (``.yaml``, ``.yml``, ``.md``) or from a YAML/Markdown string."""
    if isinstance(source, os.PathLike) or (isinstance(source, str) and _looks_like_path(source)):
        path = Path(source)
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            raise RecipeError(Problem(Location(str(path)), "recipe file not found")) from None
        except OSError as exc:
            raise RecipeError(Problem(Location(str(path)), f"cannot read the recipe: {exc.strerror}")) from None
        try:
            text = raw.decode("utf-8-sig")
        except UnicodeDecodeError as exc:
            raise RecipeError(Problem(Location(str(path)), f"not UTF-8 text (byte {exc.start})",
                                      expected="a YAML or Markdown recipe")) from None
        markdown = path.suffix.lower() in {".md", ".markdown"} or None
        return split_front_matter(text, str(path), markdown)
    if not isinstance(source, str):
        raise TypeError(f"a recipe is a path or a YAML string, not {type(source).__name__}")
    return split_front_matter(source, "<string>")


def _looks_like_path(text: str) -> bool:
    if "\n" in text:
        return False
    return text.endswith((".yaml", ".yml", ".md", ".markdown")) or os.path.exists(text)
