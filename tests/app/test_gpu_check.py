"""``scripts/gpu_check.py``, the script a session lent a GPU runs, works: here on the CPU, in bf16 autocast."""

import json

import pytest

from tests.support.paths import ROOT
from tests.support.forked import run_program


@pytest.mark.slow
def test_the_gpu_check_passes_on_the_cpu(tmp_path):
    """Both models train in bf16 under their recipes with every recal tensor on the parameters' device, resume
    exactly from a mid-run checkpoint, and export to an integer model that verifies."""
    out = tmp_path / "gpu_check.json"
    result = run_program(str(ROOT / "scripts" / "gpu_check.py"), "--device", "cpu", "--steps", "8", "--json",
                         str(out), timeout=600)
    assert result.returncode == 0 and "PASS" in result.stdout, result.stdout[-2000:] + result.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [r["model"] for r in rows] == ["resnet", "decoder"]
    assert all(r["resume_exact"] and r["verified"] and not r["off_device"] for r in rows), rows
