"""The table of ``docs/layout.md``, drawn from the tree: every package and subpackage of the libraries, what its
``__init__`` docstring says it is, its modules, and what it imports (of recal, and from outside).

Written by ``scripts/render_docs.py`` (the ``layout`` table), so a moved module or a new import shows in the docs
and ``--check`` fails until they are rendered again. The rules the imports obey are checked by
``tests/app/test_cli_core.py``: the core imports no framework, no backend imports another or the application, no
module imports a module inside another package (only that package's ``__init__``), no cycles, no module over 400
lines.
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LIBRARIES = ("recal_core", "recal_torch", "recal_keras", "recal_tf", "recal_onnx", "recal_app")


def _summary(init: Path) -> str:
    """The first sentence of a package's docstring, on one line."""
    doc = ast.get_docstring(ast.parse(init.read_text())) or ""
    first = " ".join(doc.split("\n\n")[0].split())
    first = re.sub(r"^\w+: ", "", first)  # "recal_core: the ..." -> "the ..."
    match = re.search(r"(?<=[a-z0-9)`])\.(\s|$)", first)
    first = first[:match.start()] if match else first
    first = re.sub(r":\w+:`~?([\w.]+)`", lambda m: f"`{m.group(1).rpartition('.')[2] if '~' in m.group(0) else m.group(1)}`",
                   first)  # Sphinx roles, as Markdown code
    return first.replace("``", "`").replace("|", "\\|")


def _imports(folder: Path, package: str) -> tuple[set[str], set[str]]:
    """The recal packages (subpackage level) and the outside top-level packages the modules of ``folder`` import."""
    ours, theirs = set(), set()
    for path in folder.glob("*.py"):
        here = package
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = here.rsplit(".", node.level - 1)[0] if node.level > 1 else here
                    names = [f"{base}.{node.module}" if node.module else base]
                else:
                    names = [node.module or ""]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if top.startswith("recal_"):
                    ours.add(name)
                elif top and top not in sys.stdlib_module_names and top != "__future__":
                    theirs.add(top)
    return ours, theirs


def _package_of(module: str, packages: set[str]) -> str:
    """The deepest package that holds ``module`` (a module's name, or a package's)."""
    while module not in packages:
        module = module.rpartition(".")[0]
    return module


def layout_table() -> str:
    """One row a package: what it is, its modules, what it imports."""
    packages = {".".join(p.parent.relative_to(ROOT).parts) for lib in LIBRARIES for p in (ROOT / lib).rglob("__init__.py")}
    lines = ["| package | what it is | modules | imports of recal | imports from outside |", "|---|---|---|---|---|"]
    for package in sorted(packages, key=lambda p: (LIBRARIES.index(p.split(".")[0]), p)):
        folder = ROOT.joinpath(*package.split("."))
        modules = sorted(p.stem for p in folder.glob("*.py") if p.name != "__init__.py")
        ours, theirs = _imports(folder, package)
        inside = {_package_of(m, packages) for m in ours if m.split(".")[0] in LIBRARIES}
        inside = sorted(p for p in inside if p != package and not p.startswith(package + "."))
        lines.append(f"| `{package}` | {_summary(folder / '__init__.py')} | {', '.join(f'`{m}`' for m in modules)} | "
                     f"{', '.join(f'`{p}`' for p in inside) or '-'} | {', '.join(sorted(theirs)) or '-'} |")
    return "\n".join(lines)
