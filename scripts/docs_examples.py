"""Every example in README.md and docs/ (Python blocks and ``recal`` command lines), with the install it needs, for
running them away from the checkout (scripts/check_wheel.sh, from an empty folder after installing the wheel) and in
the suite (tests/e2e/test_readme.py).

    python scripts/docs_examples.py DIR   # writes DIR/<page>-<n>.<install>.py and DIR/<page>-cli-<n>.<install>.sh

``<install>`` is ``tf`` for an example that imports TensorFlow, Keras or recal_tf (or trains with
``--framework tf``), else ``torch`` (recal[torch] with recal[huggingface] for the examples that build a
transformers model).
"""

from __future__ import annotations

import re
import shlex
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
_TF = re.compile(r"^\s*(?:from|import) (?:tensorflow|keras|recal_tf)\b", re.MULTILINE)


def pages() -> dict[str, str]:
    """``{page: text}``: the README and every docs page but docs/index.md (the README itself, generated)."""
    found = {"README": (ROOT / "README.md").read_text()}
    for path in sorted((ROOT / "docs").glob("*.md")):
        if path.name != "index.md":
            found[f"docs/{path.stem}"] = path.read_text()
    return found


def python_blocks() -> list[tuple[str, str]]:
    """``[(name, code)]``: each ```python block, named ``<page>-python-<n>``."""
    return [(f"{page}-python-{i}", code) for page, text in pages().items()
            for i, code in enumerate(re.findall(r"```python\n(.*?)```", text, re.DOTALL))]


def recal_lines() -> list[str]:
    """Each ``recal ...`` line of a ```bash block, its comment cut."""
    return [line.split("#")[0].strip() for text in pages().values()
            for block in re.findall(r"```bash\n(.*?)```", text, re.DOTALL) for line in block.splitlines()
            if line.strip().startswith("recal ")]


def short(line: str) -> list[str]:
    """A command line as argv, a ``recal train`` cut to 2 epochs (the slow tests train in full)."""
    argv = shlex.split(line)
    return argv + ["--epochs", "2", "--no-progress"] if argv[1] == "train" else argv


def install(code: str) -> str:
    """``tf`` or ``torch``: the environment an example runs in."""
    return "tf" if _TF.search(code) or "--framework tf" in code else "torch"


def write_all(folder: Path) -> list[Path]:
    """Each example as a file of its own in ``folder``, named for its page and the install it needs."""
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for name, code in python_blocks():
        written.append(folder / f"{name.replace('/', '-')}.{install(code)}.py")
        written[-1].write_text(code)
    for i, line in enumerate(recal_lines()):
        written.append(folder / f"cli-{i}.{install(line)}.sh")
        written[-1].write_text(shlex.join(short(line)) + "\n")
    return written


if __name__ == "__main__":
    for path in write_all(Path(sys.argv[1])):
        print(path.name)
