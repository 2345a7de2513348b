"""The README's examples run as written (Python blocks, and the `recal` command lines)."""

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import ROOT

README = (ROOT / "README.md").read_text()
PYTHON_BLOCKS = re.findall(r"```python\n(.*?)```", README, re.DOTALL)
BASH_BLOCKS = re.findall(r"```bash\n(.*?)```", README, re.DOTALL)
RECAL_LINES = [line.split("#")[0].strip() for block in BASH_BLOCKS for line in block.splitlines()
               if line.strip().startswith("recal ")]


def test_readme_opens_with_the_two_commands():
    first = BASH_BLOCKS[0]
    assert "make demo" in first and "make test" in first


@pytest.mark.parametrize("code", PYTHON_BLOCKS, ids=[f"python-{i}" for i in range(len(PYTHON_BLOCKS))])
def test_python_example_runs(code, tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT), RECAL_EXAMPLE_DIR=str(tmp_path))
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]


@pytest.mark.parametrize("line", RECAL_LINES)
def test_recal_command_runs(line, tmp_path):
    argv = shlex.split(line)
    # outputs go to a temp folder, inputs are read from the repository
    argv = [a if "/" in a or not a.endswith((".png", ".json", ".onnx")) else str(tmp_path / a) for a in argv]
    exe = Path(sys.executable).parent / "recal"
    result = subprocess.run([str(exe), *argv[1:]], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
