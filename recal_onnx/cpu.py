"""What this machine's onnxruntime int8 kernels do with int8 weights: exact and fast, or saturating.

x86 CPUs with VNNI or AMX (Intel since Cascade Lake, AMD since Zen 4) and Arm CPUs multiply uint8
activations by int8 weights into 32-bit sums. x86 CPUs without VNNI (AVX2, AVX-512F) add pairs of
products in 16 bits first (``vpmaddubsw``), which saturates once two neighbouring weights are both
large; there onnxruntime is exact only with uint8 weights (its u8u8 kernels), measured 2-10% slower
than u8s8 on such a CPU and about 3x slower on a CPU with AMX (``scripts/bench_zoo.py``).
"""

from __future__ import annotations

import functools
import platform
from pathlib import Path

VNNI_FLAGS = {"avx512_vnni", "avx_vnni", "amx_int8"}
X86 = {"x86_64", "amd64", "i386", "i686", "x86"}


@functools.cache
def _cpuinfo(field: str) -> str | None:
    """The first ``field`` line's value in ``/proc/cpuinfo`` ('' if absent); None where it cannot be read."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return None
    return next((line.split(":", 1)[1].strip() for line in lines if line.split(":", 1)[0].strip() == field), "")


def cpu_flags() -> frozenset[str] | None:
    """The x86 feature flags of ``/proc/cpuinfo``; None where they cannot be read (not Linux)."""
    flags = _cpuinfo("flags")
    return None if flags is None else frozenset(flags.split())


def int8_weights_exact_here() -> bool:
    """Whether onnxruntime's uint8 x int8 kernels are exact on this CPU (an x86 CPU whose flags cannot be
    read counts as one without VNNI)."""
    if platform.machine().lower() not in X86:
        return True
    flags = cpu_flags()
    return bool(flags and VNNI_FLAGS & flags)


def describe() -> str:
    """This CPU's model and int8 instructions, read off ``/proc/cpuinfo`` (facts only: what they mean for a model
    is :mod:`recal_onnx.targets`' business, and what they cost is a benchmark's)."""
    if platform.machine().lower() not in X86:
        return f"CPU: {platform.machine()} (int8 dot products in 32 bits)"
    flags = cpu_flags()
    if flags is None:
        return "CPU: x86, flags unknown (no /proc/cpuinfo)"
    model = _cpuinfo("model name") or "?"
    isa = "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "no AVX2"
    vnni = sorted(VNNI_FLAGS & flags)
    return f"CPU: {model}, {isa}, " + (f"with {' '.join(vnni)}" if vnni else "no VNNI (int8 weights beyond +-64 "
                                                                               "saturate in onnxruntime's u8s8 kernels)")
