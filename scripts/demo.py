"""`make demo`: the main job end to end on the bundled defaults.

Validates every shipped recipe and prints what each does per epoch (recal check).
"""

from __future__ import annotations

import sys
from pathlib import Path

from recal_core.cli import main as recal

RECIPES = Path(__file__).resolve().parent / "recipes"


def run() -> int:
    for recipe in sorted(RECIPES.glob("*.yaml")):
        print(f"\n$ recal check {recipe.relative_to(RECIPES.parent.parent)} --steps-per-epoch 2")
        code = recal(["check", str(recipe), "--steps-per-epoch", "2"])
        if code:
            return code
    return 0


if __name__ == "__main__":
    sys.exit(run())
