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

from .bundled import bundled_path
from .errors import Location, Problem, RecipeError
from .input_gate import InputFileError, read_bounded


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


# Limits: a recipe is a small file; these keep a hostile one from taking unbounded time or memory.
MAX_RECIPE_BYTES = 1_000_000
MAX_DEPTH = 64  # nesting of mappings and lists
MAX_NODES = 200_000  # values after expanding every alias (a "billion laughs" file is refused)


class _RecipeLoader(yaml.SafeLoader):
    """SafeLoader subclass: recipe tags, YAML 1.2 scalars, duplicate keys refused, bounded size.

    Plain scalars resolve as in YAML 1.2's core schema, not PyYAML's YAML 1.1: ``1:30`` is a string
    (not 90), ``yes``/``on`` are strings (not booleans), ``010`` is 10 (not 8) and ``8e-5`` is a
    float. ``add_constructor`` copies the class tables on first use in a subclass, and the resolver
    table is this class's own, so ``yaml.SafeLoader`` itself stays untouched.
    """

    recipe_text: RecipeText
    yaml_implicit_resolvers: dict = {}  # this class's own table (filled below), not SafeLoader's

    def compose_node(self, parent, index):
        depth = getattr(self, "_depth", 0)
        if depth >= MAX_DEPTH:
            raise yaml.composer.ComposerError(None, None, f"nesting deeper than {MAX_DEPTH} levels",
                                              self.peek_event().start_mark)
        self._depth = depth + 1
        try:
            return super().compose_node(parent, index)
        finally:
            self._depth = depth

    def construct_mapping(self, node, deep=False):
        """Every key once: a second ``modifiers:`` or a repeated ``lr_kwargs`` key is an error, never
        a silent last-one-wins."""
        if isinstance(node, yaml.MappingNode):
            self.flatten_mapping(node)
            seen: dict[Any, yaml.Mark] = {}
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=True)
                try:
                    first = seen.get(key)
                except TypeError:
                    continue  # an unhashable key: SafeConstructor reports it
                if first is not None:
                    raise yaml.constructor.ConstructorError(
                        None, None,
                        f"key {key!r} given twice (first at line {first.line + 1 + self.recipe_text.line_offset})",
                        key_node.start_mark)
                seen[key] = key_node.start_mark
        return super().construct_mapping(node, deep=deep)


_YAML12_RESOLVERS = [
    ("tag:yaml.org,2002:null", r"^(?:~|null|Null|NULL|)$", list("~nN") + [""]),
    ("tag:yaml.org,2002:bool", r"^(?:true|True|TRUE|false|False|FALSE)$", list("tTfF")),
    ("tag:yaml.org,2002:int", r"^(?:[-+]?[0-9]+|0o[0-7]+|0x[0-9a-fA-F]+)$", list("-+0123456789")),
    ("tag:yaml.org,2002:float",
     r"^(?:[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$",
     list("-+0123456789.")),
]
for _tag, _pattern, _first in _YAML12_RESOLVERS:
    _RecipeLoader.add_implicit_resolver(_tag, re.compile(_pattern), _first)


def _construct_int(loader: _RecipeLoader, node: yaml.Node) -> int:
    """YAML 1.2 integers: decimal (leading zeros are decimal), ``0o`` octal, ``0x`` hex."""
    text = loader.construct_scalar(node)
    try:
        if text.startswith(("0o", "0x")):
            return int(text[2:], 8 if text[1] == "o" else 16)
        return int(text, 10)
    except ValueError:  # more digits than Python converts
        raise yaml.constructor.ConstructorError(None, None, f"integer of {len(text):,} digits is out of range",
                                                node.start_mark) from None


_RecipeLoader.add_constructor("tag:yaml.org,2002:int", _construct_int)


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


def _expanded_size(root: yaml.Node, text: RecipeText) -> int:
    """How many values the document holds once every alias is expanded (shared nodes counted once per
    use), computed in time linear in the *distinct* nodes; a node that contains itself is an error."""
    sizes: dict[int, int] = {}
    active: set[int] = set()
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, done = stack.pop()
        key = id(node)
        if done:
            active.discard(key)
            children = _children(node)
            sizes[key] = min(MAX_NODES + 1, 1 + sum(sizes[id(c)] for c in children))
            continue
        if key in sizes:
            continue
        if key in active:
            raise RecipeError(Problem(text.location(node.start_mark), "a value contains itself (a recursive alias)",
                                      expected="plain nested data"))
        active.add(key)
        stack.append((node, True))
        stack.extend((c, False) for c in _children(node) if id(c) not in sizes)
    return sizes[id(root)]


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    if isinstance(node, yaml.MappingNode):
        return [n for pair in node.value for n in pair]
    return []


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
        size = _expanded_size(node, text)
        if size > MAX_NODES:
            raise RecipeError(Problem(text.location(node.start_mark),
                                      f"the recipe expands to more than {MAX_NODES:,} values (through aliases)",
                                      expected="a recipe that spells out fewer values"))
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
        raise RecipeError(Problem(text.location(loader.get_mark()), "YAML nesting too deep",
                                  expected=f"at most {MAX_DEPTH} levels")) from None
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
    """Read a recipe from a path (``.yaml``, ``.yml``, ``.md``), a bundled recipe's name (``recal:prune_quant``,
    :mod:`recal_core.bundled`) or a YAML/Markdown string."""
    if isinstance(source, str):
        try:
            source = bundled_path(source) or source
        except FileNotFoundError as exc:
            raise RecipeError(Problem(Location(source), str(exc))) from None
    if isinstance(source, os.PathLike) or (isinstance(source, str) and _looks_like_path(source)):
        path = Path(source)
        try:
            size = path.stat().st_size
            if size > MAX_RECIPE_BYTES:
                raise RecipeError(Problem(Location(str(path)), f"the recipe file is {size:,} bytes",
                                          expected=f"a recipe of at most {MAX_RECIPE_BYTES:,} bytes"))
            raw = read_bounded(path, MAX_RECIPE_BYTES, "recipe")  # a FIFO or a device refused, the limit counted
        except InputFileError as exc:
            raise RecipeError(Problem(Location(str(path)), str(exc).split(": ", 1)[-1],
                                      expected=f"a regular file of at most {MAX_RECIPE_BYTES:,} bytes")) from None
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
    if len(source) > MAX_RECIPE_BYTES:
        raise RecipeError(Problem(Location("<string>"), f"the recipe text is {len(source):,} characters",
                                  expected=f"a recipe of at most {MAX_RECIPE_BYTES:,} characters"))
    return split_front_matter(source, "<string>")


def _looks_like_path(text: str) -> bool:
    if "\n" in text:
        return False
    return text.endswith((".yaml", ".yml", ".md", ".markdown")) or os.path.exists(text)


MAX_EXPANDED_CHARS = 2_000_000  # what a recipe may hold once expanded: its reports and run records stay small


def text_size(value: Any) -> int:
    """The characters ``value`` takes when written out (about: keys, strings, numbers), without recursion."""
    size, stack = 0, [value]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
        size += len(item) if isinstance(item, str) else 8
    return size
