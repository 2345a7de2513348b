"""Speed on a realistic CNN: fp32 vs recal's int8 vs onnxruntime's own ``quantize_static``, one table.

A ResNet-18-shaped model at 224x224 (random weights; a few float steps, then a few QAT steps under
recal on synthetic data, so BatchNorm statistics and QAT observers hold real ranges) is exported and
converted with recal's defaults (7-bit weights, ``reduce_range: true``; target ``any``), and so is a copy with half
its filters pruned and thinned (``recal_torch.thin``); onnxruntime's ``quantize_static`` quantizes the fp32 model
as it comes and with ``reduce_range=True`` (:mod:`bench.peers`). onnxruntime runs each model at batch 1 on one thread,
the models in turn, and the table reports median latency, size, the speed-up over fp32 and fidelity: each model
in a default session against the model it was made from, run as written (recal: its QAT export; onnxruntime's:
the fp32 model, and its own QDQ file). The rows are saved as ``speed.json``. Used by ``make demo``; also alone:

    python scripts/speed.py [--size 224] [--rounds 15] [--output speed_out]
"""

from __future__ import annotations

import argparse
import copy
import math
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import onnxruntime as ort
import torch

from recal_onnx import cpu, quantize_qat_export
from recal_torch import ScheduledModifierManager, count_macs, export_onnx, thin

from bench.models import QAT_RECIPE, ResNet18, templates, train_steps
from bench.results import machine, save
from bench.peers import STATIC, STATIC_REDUCED, fidelity, static_peers
from bench.timing import interleaved_latency

@dataclass
class SpeedRow:
    label: str
    path: Path
    latency_ms: float = float("nan")  # median, batch 1, one thread
    note: str = ""
    reference: str = ""  # what its fidelity is measured against, run as written
    agreement: float = float("nan")  # argmax agreement with the reference, default onnxruntime session
    max_diff: float = float("nan")  # largest output difference, share of the reference's range
    own_agreement: float = float("nan")  # a peer's file in a default session vs the same file run as written
    steps: float | None = None  # recal's int8: largest difference from its QAT export, in output steps

    @property
    def size_mb(self) -> float:
        return self.path.stat().st_size / 1e6


FILTERS_RECIPE = """
- !EpochRangeModifier {start_epoch: 0, end_epoch: 1}
- !GradualKSModifier {params: ['re:.*conv\\d', 're:.*down.0'], init_sparsity: 0.5, final_sparsity: 0.5,
                      start_epoch: 0, end_epoch: 1, update_frequency: 1, mask_type: filter}
- !QuantizationModifier {start_epoch: 0, freeze_bn_stats_epoch: 0.5, reduce_range: true}
"""
"""Half of the filters of every conv (the classifier's outputs are the logits), at step 0, then QAT."""


def qat_int8(model: torch.nn.Module, recipe: str, sample, folder: Path, label: str, steps: int, batch: int,
             log=print) -> tuple[Path, int, float | None]:
    """``recipe`` (QAT, maybe filter pruning) for ``steps`` on ``model``, thinned, exported, converted by
    ``quantize_qat_export``; the int8 model's path, its multiply-adds, and its largest difference from the QAT
    export in output steps (verification, 16 inputs)."""
    one = sample(1)[0]
    manager = ScheduledModifierManager.from_yaml(recipe)
    optimizer = manager.modify(model, torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9),
                               steps_per_epoch=steps)
    train_steps(model, optimizer, sample, steps, batch)
    manager.finalize(model)
    report = thin(model.eval())
    macs = count_macs(model, one)[0]
    qat, int8 = folder / f"{label}.qat.onnx", folder / f"{label}.int8.onnx"
    export_onnx(model, one, qat, dynamo=False)
    check = {"input": np.concatenate([sample(1)[0].numpy() for _ in range(16)])}
    started = time.perf_counter()
    result = quantize_qat_export(qat, int8, inputs=check)
    log(f"  {label}: {report.removed} channels thinned, {macs / 1e9:.2f} G MACs; quantize_qat_export "
        f"{time.perf_counter() - started:.1f}s, verified: {result.verification}; {result.weights_note}")
    return int8, macs, result.verification.max_steps


def build_models(folder: Path, size: int = 224, float_steps: int = 3, qat_steps: int = 4, batch: int = 8,
                 log=print) -> tuple[dict[str, Path], list[dict[str, np.ndarray]], dict[str, float | None]]:
    """Train, export and convert; return the ONNX paths by label, a few synthetic inputs, and each recal int8
    model's largest difference from its QAT export in output steps."""
    torch.manual_seed(0)
    sample = templates((3, size, size), 10)
    model = ResNet18(classes=10)
    started = time.perf_counter()
    train_steps(model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9), sample, float_steps, batch)
    paths = {"fp32": folder / "resnet18.fp32.onnx"}
    export_onnx(model.eval(), sample(1)[0], paths["fp32"], dynamo=False)
    pruned = copy.deepcopy(model)
    log(f"  ResNet-18 at {size}x{size}: {float_steps} float steps, exported ({time.perf_counter() - started:.0f}s)")
    steps = {}
    paths["recal"], _, steps["recal"] = qat_int8(model, QAT_RECIPE, sample, folder, "resnet18", qat_steps, batch, log)
    paths["thinned"], _, steps["thinned"] = qat_int8(pruned, FILTERS_RECIPE, sample, folder, "resnet18.filters50",
                                                     qat_steps, batch, log)
    feeds = [{"input": sample(1)[0].numpy()} for _ in range(16)]
    started = time.perf_counter()
    paths.update(static_peers(paths["fp32"], folder, feeds[:8]))
    log(f"  onnxruntime quantize_static (QDQ, U8S8, per-channel; as it comes and reduce_range): "
        f"{time.perf_counter() - started:.1f}s")
    return paths, feeds, steps


def speed_table(folder: Path, size: int = 224, rounds: int = 15, checks: int = 64, log=print) -> list[SpeedRow]:
    """Build, time and check the models (see the module); the rows are also written to ``folder/speed.json``."""
    folder.mkdir(parents=True, exist_ok=True)
    paths, feeds, steps = build_models(folder, size, log=log)
    qat = {"recal": folder / "resnet18.qat.onnx", "thinned": folder / "resnet18.filters50.qat.onnx"}
    rows = [SpeedRow("fp32 (PyTorch export)", paths["fp32"], reference="itself"),
            SpeedRow("recal int8 (7-bit QAT -> quantize_qat_export)", paths["recal"], reference="its QAT export"),
            SpeedRow(f"{STATIC} (8-bit weights)", paths[STATIC], reference="fp32"),
            SpeedRow(f"{STATIC_REDUCED} (7-bit)", paths[STATIC_REDUCED], reference="fp32"),
            SpeedRow("recal 50% filters + 7-bit QAT int8, thinned", paths["thinned"], reference="its QAT export")]
    measured = interleaved_latency({r.label: r.path for r in rows}, feeds[0], rounds)
    rng = np.random.default_rng(1)
    batch = {"input": np.concatenate([feeds[i % len(feeds)]["input"] for i in range(checks)])
             + 0.1 * rng.standard_normal((checks, 3, size, size)).astype(np.float32)}
    for row, key in zip(rows, ["fp32", "recal", STATIC, STATIC_REDUCED, "thinned"]):
        row.latency_ms = measured[row.label]
        row.steps = steps.get(key)
        reference = qat[key] if row.reference == "its QAT export" else paths["fp32"]
        row.agreement, row.max_diff = fidelity(row.path, reference, batch)
        if row.reference == "fp32":  # onnxruntime's own file: does a default session compute what it says?
            row.own_agreement = fidelity(row.path, row.path, batch)[0]
    save(folder / "speed.json", {"size": size, "rounds": rounds, "checks": checks, **machine(),
                                 "rows": [{**asdict(r), "path": str(r.path), "size_mb": r.size_mb} for r in rows]})
    return rows


def format_table(rows: list[SpeedRow]) -> str:
    base = rows[0]
    lines = [f"{'model':46s} {'size':>9s} {'x fp32':>7s} {'latency':>10s} {'speed-up':>9s} {'agree':>6s} "
             f"{'max diff':>8s}  reference (as written)"]
    for row in rows:
        own = "" if math.isnan(row.own_agreement) else f"; its own file as written: {row.own_agreement:.3f}"
        own += f", within {row.steps:.0f} output step(s)" if row.steps is not None else ""
        lines.append(f"{row.label:46s} {row.size_mb:7.2f}MB {row.size_mb / base.size_mb:7.3f} "
                     f"{row.latency_ms:8.2f}ms {base.latency_ms / row.latency_ms:8.2f}x {row.agreement:6.3f} "
                     f"{100 * row.max_diff:7.2f}%  {row.reference}{own}")
    return "\n".join(lines)


def measured_line(rows: list[SpeedRow]) -> str:
    """This CPU and what this run measured on it, in one sentence (no fixed claims)."""
    by = {r.label.split(" (")[0]: r for r in rows}
    recal, static, reduced = by["recal int8"], by[STATIC], by[STATIC_REDUCED]
    within = f", within {recal.steps:.0f} output step(s) of its QAT export" if recal.steps is not None else ""
    return (f"{cpu.describe()}. Measured this run: recal int8 {rows[0].latency_ms / recal.latency_ms:.2f}x fp32 and "
            f"{static.latency_ms / recal.latency_ms:.2f}x quantize_static's speed{within}; quantize_static's own "
            f"file in a default session agrees with itself run as written on {100 * static.own_agreement:.1f}% of "
            f"argmaxes (reduce_range: {100 * reduced.own_agreement:.1f}%)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--output", default="speed_out")
    args = parser.parse_args(argv)
    torch.set_num_threads(2)
    rows = speed_table(Path(args.output), args.size, args.rounds)
    print(f"\nResNet-18-shaped, {args.size}x{args.size}, synthetic inputs, onnxruntime {ort.__version__}, "
          f"batch 1, 1 thread, median of {args.rounds * 3} runs each (interleaved)")
    print(format_table(rows))
    print(measured_line(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
