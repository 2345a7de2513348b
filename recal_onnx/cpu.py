"""What this machine's onnxruntime int8 kernels do with int8 weights: exact and fast, or saturating; asked of
onnxruntime itself (:func:`probed_int8_exact`), the CPU's flags kept as the description.

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


PROBE_PRODUCTS = 64  # uint8 255 x int8 127, summed: 2,072,640 exactly; 1,048,544 where pairs saturate in 16 bits


@functools.cache
def probed_int8_exact() -> bool | None:
    """Ask onnxruntime itself, once a process: a ``MatMulInteger`` of :data:`PROBE_PRODUCTS` products of uint8 255
    by int8 127, whose exact sum its x86 kernels without VNNI cannot reach (pairs of products saturate at 32,767).
    None where the probe does not run. This is the ground truth: ``/proc/cpuinfo`` is the host's under an emulator
    (``qemu-x86_64 -cpu Haswell``) and disagrees with ``cpuid`` in virtual machines that mask its leaves."""
    try:
        import numpy as np
        import onnxruntime as ort
        from onnx import TensorProto, helper, numpy_helper

        weight = numpy_helper.from_array(np.full((PROBE_PRODUCTS, 1), 127, np.int8), "w")
        graph = helper.make_graph([helper.make_node("MatMulInteger", ["a", "w"], ["y"])], "probe",
                                  [helper.make_tensor_value_info("a", TensorProto.UINT8, [1, PROBE_PRODUCTS])],
                                  [helper.make_tensor_value_info("y", TensorProto.INT32, [1, 1])], [weight])
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
        options = ort.SessionOptions()
        options.log_severity_level = 4
        session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
        got = session.run(None, {"a": np.full((1, PROBE_PRODUCTS), 255, np.uint8)})[0]
    except Exception:  # noqa: BLE001 - no answer from onnxruntime: the flags decide
        return None
    return int(got.reshape(-1)[0]) == 255 * 127 * PROBE_PRODUCTS


def _flags_say_exact() -> bool:
    if platform.machine().lower() not in X86:
        return True
    flags = cpu_flags()
    return bool(flags and VNNI_FLAGS & flags)


def int8_weights_exact_here() -> bool:
    """Whether onnxruntime's uint8 x int8 kernels are exact on this CPU: what :func:`probed_int8_exact` finds, else
    (no probe) the flags (an x86 CPU whose flags cannot be read counts as one without VNNI)."""
    probed = probed_int8_exact()
    return _flags_say_exact() if probed is None else probed


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
    said = f"CPU: {model}, {isa}, " + (f"with {' '.join(vnni)}" if vnni else "no VNNI (int8 weights beyond +-64 "
                                                                              "saturate in onnxruntime's u8s8 kernels)")
    probed = probed_int8_exact()
    if probed is not None and probed != bool(vnni):  # an emulator, or a virtual machine masking cpuid
        said += ("; but onnxruntime's own u8s8 kernels " + ("are exact here" if probed else "saturate here (as on "
                 "a CPU without VNNI: an emulator or a virtual machine that masks cpuid)"))
    return said
