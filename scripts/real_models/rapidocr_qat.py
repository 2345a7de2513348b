"""QAT on weights no one here trained: RapidOCR's PP-OCRv4 text recognizer (from the ``rapidocr_onnxruntime`` wheel)
brought into PyTorch (:mod:`real_models.onnx_to_torch`), trained under a recal recipe (int8 QAT, distilled from the
fp32 model), exported, converted, and judged beside onnxruntime's ``quantize_static`` (PTQ) on the same rendered lines.

Training lines come from other modules' source than the judged ones (:data:`TRAINING_SOURCES`; no judged line is
drawn), rendered the same way. Fidelity is against the fp32 model on held-out lines: top-1 agreement per position
(what the table of docs/converter.md reports) and the greedy CTC reading, exact line for line and its character
error rate against fp32's reading. The share of PTQ's loss won back is ``(QAT - PTQ) / (fp32 - PTQ)`` on agreement,
fp32 being 1, PTQ at its best: ``quantize_static`` on the file as shipped, or after ``quant_pre_process`` (the
pre-processing its log advises), whichever agrees more.

    pip download --no-deps rapidocr_onnxruntime==1.4.4 -d /tmp/w && unzip -o -q /tmp/w/*.whl -d /tmp/w
    pip install --no-deps onnx2torch
    python scripts/real_models/rapidocr_qat.py --wheel /tmp/w/rapidocr_onnxruntime/models --seeds 0 1 2 \\
        --json docs/results/real_model_qat.json
"""

from __future__ import annotations

import argparse
import copy
import sys
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np
import torch
from onnxruntime.quantization.shape_inference import quant_pre_process
from torch import nn

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "scripts"), str(ROOT / "scripts" / "real_models")]
from bench.results import machine, report  # noqa: E402
from bench.timing import interleaved_latency, spread  # noqa: E402
from onnx_to_torch import torch_model  # noqa: E402
from rapidocr_quantize import TRAINING_SOURCES, quantize_rendered, text_lines  # noqa: E402
from recal_onnx import quantize_qat_export  # noqa: E402
from recal_onnx import session  # noqa: E402
from recal_torch import ScheduledModifierManager, export_onnx  # noqa: E402

RECIPE = """
- !EpochRangeModifier {{start_epoch: 0, end_epoch: 1}}
- !LearningRateFunctionModifier {{start_epoch: 0, end_epoch: 1, lr_func: cosine, init_lr: {lr}, final_lr: {final_lr}}}
- !QuantizationModifier
  start_epoch: 0
  freeze_bn_stats_epoch: 0.5
  scheme:
    input_activations: {{symmetric: false, observer: {observer}}}
    weights: {{observer: {observer}}}
- !DistillationModifier {{start_epoch: 0, end_epoch: 1, hardness: 1.0, temperature: 1.0}}
"""  # the whole loss from the fp32 model: no labels needed, the user's own unlabelled lines suffice
RECOGNIZER = "ch_PP-OCRv4_rec_infer.onnx"
HEIGHT, WIDTH = 48, 192


class LogProbs(nn.Module):
    """The recognizer's per-position probabilities as log-probabilities: what distillation softens (softmax of
    them gives the probabilities back)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, x):
        return torch.log(self.model(x).clamp_min(1e-30))


def train(model: nn.Module, teacher: nn.Module, steps: int, batch: int, lr: float, observer: str, seed: int) -> float:
    torch.manual_seed(seed)
    manager = ScheduledModifierManager.from_yaml(RECIPE.format(lr=lr, final_lr=lr / 20, observer=observer))
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    first, _ = text_lines(batch, seed=1000 * seed, modules=TRAINING_SOURCES)
    optimizer = manager.modify(model, optimizer, steps_per_epoch=steps, teacher=LogProbs(teacher).eval(),
                               example_inputs=torch.from_numpy(first[:2]))
    student, loss, t0 = LogProbs(model).train(), float("nan"), time.perf_counter()
    for step in range(steps):
        x = torch.from_numpy(first if step == 0 else
                             text_lines(batch, seed=1000 * seed + step, modules=TRAINING_SOURCES)[0])
        optimizer.zero_grad()
        loss_t = manager.loss(torch.zeros(()), x, student(x))
        loss_t.backward()
        optimizer.step()
        loss = float(loss_t)
        if step % max(1, steps // 5) == 0 or step == steps - 1:
            print(f"    step {step:4d}  KD loss {loss:.4f}  {time.perf_counter() - t0:5.0f}s", flush=True)
    manager.finalize(model)
    return loss


def outputs(path: Path, x: np.ndarray) -> np.ndarray:
    s = session(str(path))
    name = s.get_inputs()[0].name
    return np.concatenate([s.run(None, {name: x[i:i + 1]})[0] for i in range(len(x))])


def readings(probs: np.ndarray) -> list[tuple[int, ...]]:
    """Greedy CTC: the per-position argmax, repeats merged, blanks (class 0) dropped."""
    lines = []
    for row in probs.argmax(-1):
        kept = [int(c) for i, c in enumerate(row) if c != 0 and (i == 0 or c != row[i - 1])]
        lines.append(tuple(kept))
    return lines


def _edits(a: tuple, b: tuple) -> int:
    previous = list(range(len(b) + 1))
    for i, x in enumerate(a, 1):
        current = [i]
        for j, y in enumerate(b, 1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (x != y)))
        previous = current
    return previous[-1]


def fidelity(probs: np.ndarray, reference: np.ndarray) -> dict:
    got, want = readings(probs), readings(reference)
    return {"agreement": float(np.mean(probs.argmax(-1) == reference.argmax(-1))),
            "lines_read_alike": float(np.mean([g == w for g, w in zip(got, want)])),
            "cer": sum(_edits(g, w) for g, w in zip(got, want)) / max(1, sum(len(w) for w in want))}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--wheel", type=Path, required=True, help="the unpacked rapidocr_onnxruntime wheel's models/")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--observer", default="minmax", choices=["minmax", "mse", "lsq"])
    parser.add_argument("--samples", type=int, default=128, help="held-out rendered lines judged on")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    torch.set_num_threads(2)
    fp32 = args.wheel / RECOGNIZER
    x, _ = text_lines(args.samples, seed=2)
    reference = outputs(fp32, x)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        # the pre-processing quantize_static's log advises; its symbolic shape inference cannot follow this model's
        # reshapes, which its documented skip_symbolic_shape leaves out (onnx's shape inference and the optimizer run)
        quant_pre_process(str(fp32), str(folder / "pre.onnx"), skip_symbolic_shape=True)
        ptq = quantize_rendered(fp32, folder / "ptq.onnx")
        pre = quantize_rendered(folder / "pre.onnx", folder / "ptq_pre.onnx")
        rows = {"quantize_static": fidelity(outputs(ptq, x), reference)}
        try:
            rows["quantize_static, pre-processed"] = fidelity(outputs(pre, x), reference)
        except Exception as exc:  # noqa: BLE001 - a file onnxruntime cannot load is a row too: why
            rows["quantize_static, pre-processed"] = {"failed": " ".join(str(exc).split())[:300]}
            pre = None
        converted = quantize_qat_export(ptq, folder / "ptq.int8.onnx", inputs={"x": x[:32]})
        rows["quantize_static, recal-converted"] = fidelity(outputs(converted.path, x), reference)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # onnx2torch's tracer notes on its own shape ops
            base = torch_model(fp32, HEIGHT, WIDTH)
        qat_rows, latency_paths = [], {"fp32": fp32, "quantize_static": ptq, "quantize_static, pre-processed": pre,
                                       "recal (PTQ file)": converted.path}
        latency_paths = {k: p for k, p in latency_paths.items() if p is not None}
        for seed in args.seeds:
            print(f"  QAT seed {seed}", flush=True)
            model, t0 = copy.deepcopy(base), time.perf_counter()
            loss = train(model, copy.deepcopy(base), args.steps, args.batch, args.lr, args.observer, seed)
            minutes = (time.perf_counter() - t0) / 60
            qat = export_onnx(model.eval(), torch.from_numpy(x[:1]), folder / f"qat{seed}.onnx", input_names=["x"],
                              output_names=["probs"], dynamic_batch=False, dynamo=False)
            result = quantize_qat_export(qat, folder / f"qat{seed}.int8.onnx", inputs={"x": x[:32]})
            qat_rows.append({"seed": seed, "final_kd_loss": loss, "train_minutes": minutes,
                             "QDQ": fidelity(outputs(qat, x), reference),
                             "recal": fidelity(outputs(result.path, x), reference),
                             "verified": str(result.verification), "float_ops": result.float_ops,
                             "size": result.path.stat().st_size})
            latency_paths[f"recal QAT (seed {seed})"] = result.path
        latency = interleaved_latency(latency_paths, {"x": x[:1]}, rounds=7, min_seconds=0.05)
        sizes = {k: Path(p).stat().st_size for k, p in latency_paths.items()}
    ptq_agreement = max(r["agreement"] for k, r in rows.items() if "recal" not in k and "failed" not in r)
    won = [(r["recal"]["agreement"] - ptq_agreement) / (1 - ptq_agreement) for r in qat_rows]
    data = {**machine(), "model": "RapidOCR PP-OCRv4 text recognizer", "samples": args.samples,
            "steps": args.steps, "batch": args.batch, "lr": args.lr, "observer": args.observer,
            "ptq": rows, "qat": qat_rows, "share_won_back": won, "latency_ms": latency, "sizes": sizes}
    return report(data, table(data), args.json)


def table(data: dict) -> str:
    lines = ["| model | top-1 per position vs fp32 | lines read as fp32 reads them | CER vs fp32 |", "|---" * 4 + "|"]
    for label, r in data["ptq"].items():
        if "failed" in r:
            why = r["failed"].split("failed:", 1)[-1].strip()  # onnxruntime's words, without the temporary path
            lines.append(f"| {label} | onnxruntime cannot load the file: {why[:110]}... | | |")
            continue
        lines.append(f"| {label} | {r['agreement']:.3f} | {r['lines_read_alike']:.3f} | {r['cer']:.3f} |")
    q = data["qat"]
    cells = [spread([r["recal"][k] for r in q]) for k in ("agreement", "lines_read_alike", "cer")]
    lines.append(f"| recal QAT, {len(q)} seed(s): median (least-most) | " +
                 " | ".join(f"{c[1]:.3f} ({c[0]:.3f}-{c[2]:.3f})" for c in cells) + " |")
    won = spread(data["share_won_back"])
    lines.append(f"\nShare of PTQ's (at its best) agreement loss won back by QAT: {won[1]:.0%} ({won[0]:.0%}-{won[2]:.0%}); "
                 f"latency ms: " + ", ".join(f"{k} {v:.2f}" for k, v in data["latency_ms"].items()))
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
