"""The default target's second file: the converted model with its weights beyond +-64 stored as uint8.

One file cannot be both exact and fast on every x86 CPU (:mod:`recal_onnx.targets`): int8 weights are exact and fast
with VNNI or AMX and on Arm, and saturate in the u8s8 kernels of x86 CPUs without VNNI; uint8 weights (zero point
128, the same values) are exact there and about 3x slower with VNNI/AMX. So target ``any`` writes the int8 model
where the user asked and, when some layer has weights beyond +-64, this twin beside it: the same integers, one
verification. Each file names the CPUs it is exact on in its metadata (``recal.exact_on``).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx

from .passes import uint8_twin

EXACT_ON = "recal.exact_on"
INT8_CPUS = "x86 with VNNI or AMX, Arm"
UINT8_CPUS = "every CPU (x86 without VNNI included)"
TWIN_SAMPLES = 16  # the twin is compared with the verified model on this many samples


def avx2_twin(model: onnx.ModelProto) -> onnx.ModelProto | None:
    """``model`` with every weight beyond +-64 stored as uint8, zero point 128; None where it has none."""
    twin = uint8_twin(model)
    if twin is not None:
        mark(twin, UINT8_CPUS)
    return twin


def mark(model: onnx.ModelProto, cpus: str) -> None:
    """Write which CPUs ``model`` is exact on into its metadata (replacing an earlier entry)."""
    kept = [p for p in model.metadata_props if p.key != EXACT_ON]
    del model.metadata_props[:]
    model.metadata_props.extend(kept)
    onnx.helper.set_model_props(model, {**{p.key: p.value for p in kept}, EXACT_ON: cpus})


def twin_path(output_path: str | Path) -> Path:
    """Where the twin of a model written to ``output_path`` goes: ``model.onnx`` -> ``model.x86-avx2.onnx``."""
    path = Path(output_path)
    return path.with_name(f"{path.stem}.x86-avx2{path.suffix or '.onnx'}")


def twin_differs(model: onnx.ModelProto, twin: onnx.ModelProto, inputs: dict[str, np.ndarray]) -> str | None:
    """Where both run exactly (this CPU has VNNI / AMX, or is not x86): the first output on which the twin's values
    differ from the model's on the first samples of ``inputs``, else None."""
    from .verify import fixed_batch, run_batches, session

    fixed = fixed_batch(model)
    count = max(TWIN_SAMPLES // fixed, 1) * fixed if fixed else TWIN_SAMPLES
    sample = {k: v[:count] if np.ndim(v) else v for k, v in inputs.items()}
    mine, theirs = run_batches(session(model), sample, fixed), run_batches(session(twin), sample, fixed)
    names = [o.name for o in model.graph.output]
    return next((name for name, a, b in zip(names, mine, theirs) if not np.array_equal(a, b, equal_nan=True)), None)
