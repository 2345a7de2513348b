"""Exactness by CPU class: the AVX2 suite's models (``tests/support/avx2_emulated_run.py``) converted and verified here, on
this CPU's own kernels, and under ``qemu-x86_64 -cpu Haswell`` (onnxruntime's AVX2 kernels, no VNNI). Exactness
only: an emulated run is 20x slower and says nothing of speed, so no time is printed for it.

    python scripts/avx2_exactness.py [--json docs/results/avx2_exactness.json]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RUN = ROOT / "tests" / "support" / "avx2_emulated_run.py"


def _run(out: Path, emulate: bool) -> dict:
    qemu = shutil.which("qemu-x86_64")
    if emulate and qemu is None:
        raise SystemExit("qemu-x86_64 not found: apt-get install qemu-user")
    command = ([qemu, "-cpu", "Haswell"] if emulate else []) + [sys.executable, str(RUN), str(out)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=1200, cwd=ROOT)
    if done.returncode:
        raise SystemExit(done.stderr[-2000:])
    return json.loads(done.stdout.strip().splitlines()[-1])


def verdict(entry: dict, exact: bool) -> str:
    """One table cell: what verification said of the file the conversion checked on this CPU's kernels (the int8
    file where they are exact, else its ``.x86-avx2.onnx`` twin), and of the int8 file where that was the twin."""
    int8 = entry.get("int8 file")
    checked = ("the x86-avx2 twin" if not exact else "the int8 file") if int8 is not None else "the model"
    said = f"{checked} {'verified' if entry['verified'] else 'refused'}"
    if int8 is not None and not exact:
        said += "; the int8 file " + ("verifies" if int8["problem"] is None else "is refused (saturation)")
    return said


def table(data: dict) -> str:
    lines = ["| model | " + " | ".join(run["label"] for run in data["runs"]) + " |", "|---" * (1 + len(data["runs"]))
             + "|"]
    roles = list(data["runs"][0]["found"]["models"])
    for role in roles:
        first = data["runs"][0]["found"]["models"][role]
        lines.append(f"| {role} ({first['file']}) | "
                     + " | ".join(verdict(run["found"]["models"][role], run["found"]["probe_exact"])
                                  for run in data["runs"]) + " |")
    tiny = [run["found"] for run in data["runs"]]
    lines.append("| a conv of 64 int8 127 weights, target native | " + " | ".join(
        f"{t['tiny native']['target']}, {t['tiny native']['weights'][0].lower()} weights, "
        f"{'verified' if t['tiny native']['verified'] else 'refused'}; int8 weights: "
        f"{t['tiny int8']['max_steps']:.0f} steps off" for t in tiny) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="save the runs here (docs/results/avx2_exactness.json)")
    args = parser.parse_args(argv)
    runs = []
    with tempfile.TemporaryDirectory() as folder:
        for emulate in (False, True):
            found = _run(Path(folder) / ("haswell" if emulate else "native"), emulate)
            label = ("emulated Haswell (qemu-x86_64 -cpu Haswell: AVX2 kernels, exactness only)" if emulate
                     else f"this CPU ({found['describe'].removeprefix('CPU: ')})")
            for entry in found["models"].values():
                entry.pop("seconds", None)  # an emulated time is no speed; a native one here is noise
            for key in ("tiny native",):
                found[key].pop("seconds", None)
            runs.append({"label": label, "emulated": emulate, "found": found})
    data = {"runs": runs}
    print(table(data))
    if args.json:
        args.json.write_text(json.dumps(data, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
