"""Exactness on onnxruntime's AVX2 kernels (x86 without VNNI), checked on every run under an emulated Haswell:
``qemu-x86_64 -cpu Haswell`` runs this project's Python, numpy and onnxruntime, which reads the CPU with ``cpuid``
and dispatches its AVX2 kernels, whose uint8 x int8 pair sums saturate exactly as on a real AVX2 CPU. Emulated
timings are not speed: nothing here measures any."""

import json
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RUN = ROOT / "tests" / "support" / "avx2_emulated_run.py"
QEMU = shutil.which("qemu-x86_64")

pytestmark = [pytest.mark.avx2, pytest.mark.skipif(
    platform.machine().lower() not in ("x86_64", "amd64") or QEMU is None,
    reason="qemu-x86_64 not found: `apt-get install qemu-user` runs the AVX2 exactness suite under an emulated "
           "Haswell")]


def _run(out: Path) -> dict:
    command = [QEMU, "-cpu", "Haswell", sys.executable, str(RUN), str(out)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_exact_on_avx2_kernels_under_an_emulated_haswell(tmp_path):
    """One emulated run (about 40 s on 2 cores; one test, so parallel workers do not each make it), then what it
    found, claim by claim."""
    emulated = _run(tmp_path)
    _onnxruntime_is_asked_not_the_flags(emulated)
    _native_target_and_verification_follow_onnxruntimes_dispatch(emulated)
    _the_twin_is_exact_on_avx2_kernels_and_the_int8_file_is_not(emulated)
    for role in ("zoo CNN", "transformer", "int4 MatMulNBits"):
        _models_verify_on_avx2_kernels(emulated, role)


def _onnxruntime_is_asked_not_the_flags(emulated):
    """Under the emulated Haswell ``/proc/cpuinfo`` is the host's (VNNI here, perhaps), but onnxruntime's kernels are
    AVX2's: the probe says they saturate, and describe() says both."""
    assert emulated["probe_exact"] is False, emulated["describe"]
    assert "saturate" in emulated["describe"]


def _native_target_and_verification_follow_onnxruntimes_dispatch(emulated):
    """target="native" under the emulated Haswell writes uint8 weights and verifies exactly there (it wrote int8
    weights from the flags and its own verification refused them); the same conv with int8 weights is off by whole
    steps there: the saturation the uint8 form avoids, reproduced."""
    native = emulated["tiny native"]
    assert native["verified"] and native["target"] == "x86-avx2" and native["weights"] == ["UINT8"], native
    assert "max abs diff 0 " in native["ran"]
    assert emulated["tiny int8"]["weights"] == ["INT8"] and emulated["tiny int8"]["max_steps"] >= 2


def _the_twin_is_exact_on_avx2_kernels_and_the_int8_file_is_not(emulated):
    """An 8-bit third-party export (NNCF) converted with the default target: on AVX2 kernels its int8 file is refused
    by verification (a tensor many steps off: saturation), and the conversion, verifying the ``.x86-avx2.onnx``
    twin there, passes."""
    twin = emulated["models"]["twin of an 8-bit model"]
    assert twin["verified"] and twin["twin"], twin
    assert twin["int8 file"]["problem"] and not twin["int8 file"]["clean_op_by_op"], twin["int8 file"]


def _models_verify_on_avx2_kernels(emulated, role):
    """A MobileNetV2 (TF-MOT), a small BERT (NNCF) and an int4 AWQ BERT (ModelOpt, MatMulNBits) convert verified
    with onnxruntime running AVX2 kernels."""
    entry = emulated["models"][role]
    assert entry["verified"], (role, entry)
