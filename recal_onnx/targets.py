"""Which CPUs a converted model is for, and so how its int8 weights are stored: chosen by the user, never by the
CPU that happens to run the conversion.

onnxruntime multiplies uint8 activations by int8 weights. x86 CPUs with VNNI or AMX and Arm CPUs sum those
products in 32 bits: exact. x86 CPUs without VNNI (AVX2, AVX-512F) first add pairs in 16 bits (``vpmaddubsw``),
which saturates once two neighbouring weights pass ``|q1| + |q2| > 128``. Two ways out:

- weights within +-64 (QAT with the QuantizationModifier's ``reduce_range: true``) never saturate: int8 weights
  are then exact *and* fast on every CPU, and this module leaves them int8 for every target;
- weights beyond +-64 stored as uint8 with zero point 128 (the same values) run onnxruntime's u8u8 kernels,
  exact everywhere but about 3x slower than int8 on a CPU with VNNI or AMX.

The default, ``any``, writes both: the model with int8 weights (exact and fast on the CPUs most models are
deployed on: Intel Xeons since Cascade Lake, AMD since Zen 4, every Arm server) and, where some layers have weights
beyond +-64, its twin with those layers' weights uint8 beside it (``<name>.x86-avx2.onnx``: exact on x86 without
VNNI, 2-10% slower there than the saturating int8 kernels). The result and the CLI say which file is for which CPU,
and each file says so in its metadata (``recal.exact_on``).

=========== ============================================ ==========================================
target      for                                          weights beyond +-64
=========== ============================================ ==========================================
``any``     every CPU (the default)                      int8, and a uint8 twin for x86 without VNNI
``x86-avx2`` x86 without VNNI (AMD before Zen 4, many    uint8, zero point 128
            laptops and cloud instances)
``x86-vnni`` x86 with VNNI or AMX (Intel since Cascade   int8 (saturate on x86 without VNNI)
            Lake, AMD since Zen 4)
``arm64``   Arm (int8 dot products in 32 bits)           int8
``native``  the CPU running the conversion, said so      as the CPU it resolves to
=========== ============================================ ==========================================
"""

from __future__ import annotations

from dataclasses import dataclass

from .cpu import int8_weights_exact_here

TARGETS = ("any", "x86-avx2", "x86-vnni", "arm64", "native")
DEFAULT_TARGET = "any"
WEIGHT_TYPES = ("auto", "int8", "uint8")
_INT8_EXACT = {"x86-avx2": False, "x86-vnni": True, "arm64": True}


@dataclass(frozen=True)
class WeightChoice:
    """How a conversion stores its int8 weights, and why (for ``result`` and the CLI)."""

    target: str  # one of TARGETS other than "native"
    weight_type: str  # "int8": as trained; "uint8": weights beyond +-64 as uint8, zero point 128
    why: str
    twin: bool = False  # also the uint8-weight twin, for x86 without VNNI (target any)


def choose_weights(target: str = DEFAULT_TARGET, weight_type: str = "auto") -> WeightChoice:
    """The weight storage for ``target`` (``weight_type="auto"``), or the one ``weight_type`` forces.

    Args:
        target: one of :data:`TARGETS`; ``"native"`` resolves to this CPU's kind, and the reason says so.
        weight_type: ``"auto"`` (what the target computes exactly), ``"int8"`` or ``"uint8"``.

    Raises:
        ValueError: an unknown target or weight type.

    >>> choose_weights("x86-vnni").weight_type
    'int8'
    >>> choose_weights().weight_type, choose_weights().twin
    ('int8', True)
    >>> choose_weights("x86-avx2").weight_type
    'uint8'
    """
    if target not in TARGETS:
        raise ValueError(f"target must be one of {TARGETS}, got {target!r}")
    if weight_type not in WEIGHT_TYPES:
        raise ValueError(f"weight_type must be one of {WEIGHT_TYPES}, got {weight_type!r}")
    native = target == "native"
    if native:
        target = "x86-vnni" if int8_weights_exact_here() else "x86-avx2"
    source = f"target {target}" + (" (native: the CPU that converted it)" if native else "")
    if weight_type != "auto":
        return WeightChoice(target, weight_type, f"weight_type={weight_type} as asked ({source})")
    if target == "any":
        return WeightChoice(target, "int8", f"{source}: int8 weights for the CPUs that compute them exactly (x86 with "
                                            "VNNI or AMX, Arm), their uint8-weight twin for x86 without VNNI",
                            twin=True)
    if _INT8_EXACT[target]:
        return WeightChoice(target, "int8", f"{source}: int8 weights are exact there")
    return WeightChoice(target, "uint8", f"{source}: int8 weights beyond +-64 saturate on x86 without VNNI, so "
                                         "those layers store uint8 weights (exact, about 3x slower than int8 with "
                                         "VNNI / AMX); train with reduce_range: true to keep every layer int8")
