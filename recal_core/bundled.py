"""The recipes recal ships inside its package, loadable by name from any folder: ``recal:prune_quant`` wherever a
recipe path is taken (``load_recipe``, ``from_yaml``, ``recal check``, ``recal train --recipe``), listed by
``recal recipes``."""

from __future__ import annotations

from pathlib import Path

FOLDER = Path(__file__).resolve().parent / "recipes"
PREFIX = "recal:"


def bundled_recipes() -> dict[str, str]:
    """Each bundled recipe's name and the first sentence of its header comment."""
    found = {}
    for path in sorted(FOLDER.glob("*.yaml")):
        lines = []
        for line in path.read_text().splitlines():
            if not line.startswith("#"):
                break
            lines.append(line.lstrip("# ").strip())
        about = " ".join(lines)
        found[path.stem] = about.split(". ")[0].rstrip(".") if about else ""
    return found


def bundled_path(source: str) -> Path | None:
    """The file of ``recal:NAME``; None for any other source. An unknown name is a ``FileNotFoundError`` that lists
    the names there are."""
    if not source.startswith(PREFIX) or "\n" in source:
        return None
    name = source[len(PREFIX):]
    path = FOLDER / f"{name}.yaml"
    if not name.replace("_", "").isalnum() or not path.is_file():
        raise FileNotFoundError(f"no bundled recipe {source!r}; there are: "
                                + ", ".join(PREFIX + n for n in bundled_recipes()))
    return path
