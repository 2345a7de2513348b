"""Print the first ```python block under a README heading (for running the quick starts elsewhere).

    python scripts/readme_example.py "Quick start: PyTorch" > quickstart.py
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"


def example(heading: str, text: str | None = None) -> str:
    """The first Python block after the ``## heading`` line (before the next ``## `` heading)."""
    text = README.read_text() if text is None else text
    match = re.search(rf"^#+ {re.escape(heading)}\s*$(.*?)(?=^## |\Z)", text, re.MULTILINE | re.DOTALL)
    if match is None:
        raise SystemExit(f"README.md has no heading {heading!r}")
    block = re.search(r"```python\n(.*?)```", match.group(1), re.DOTALL)
    if block is None:
        raise SystemExit(f"README.md has no Python block under {heading!r}")
    return block.group(1)


if __name__ == "__main__":
    sys.stdout.write(example(sys.argv[1]))
