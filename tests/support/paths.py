"""Where the tests find the checkout, the bundled recipes and the compatibility corpus."""

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RECIPES = ROOT / "recal_core" / "recipes"
# The compatibility corpus lives beside the checkout in shared/ (CI clones main with shared/ beside it).
CORPUS = Path(os.environ.get("RECAL_COMPAT_CORPUS", ROOT.parent / "shared" / "compat" / "sparseml-recipes"))
