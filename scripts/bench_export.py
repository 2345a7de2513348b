"""What ``recal_torch.export_onnx`` costs against torch.onnx's own export of the same float model.

Two models, each export timed in turn (interleaved rounds, one process, after a warm-up export of each):

- a Llama-shaped decoder over bytes (``bench_llm.py``'s, 6 layers, hidden 256: 5.2 M parameters), its QAT twin
  int4 weight-only in groups of 32; a batch of 2 x 128 tokens, batch and sequence dynamic;
- a ResNet-18 (``bench.models``, 224 x 224), its QAT twin W8A8; a batch of 2, the batch dynamic.

Variants: ``torch.onnx.export(dynamo=True)`` of the float model (opset 18, the same dynamic axes), recal's export of
the float model, and recal's export of the QAT model (QDQ). recal's export does more than torch's: it runs the
written model in onnxruntime on a batch one row longer (and a sequence one shorter) to catch a graph that fixed
the sample's shape, and falls back to the other exporter when one fails; the QAT model's graph has a
quantize-dequantize pair per quantized tensor besides.

    python scripts/bench_export.py [--rounds 3] [--models decoder resnet18] [--json docs/results/export.json]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import tempfile
import time
import warnings
from pathlib import Path

import torch

from recal_torch import ScheduledModifierManager, export_onnx

from bench.models import ResNet18, torch_init
from bench.results import machine, save_run
from examples.int4_decoder import Logits

DECODER_QAT = ("- !QuantizationModifier {start_epoch: 0, scheme: {input_activations: null, weights: {num_bits: 4, "
               "group_size: 32, observer: minmax}}}")
CNN_QAT = "- !QuantizationModifier {start_epoch: 0}"


def _qat(model: torch.nn.Module, recipe: str, sample: torch.Tensor, loss) -> torch.nn.Module:
    """``model``'s QAT twin after one step at LR 0 (its plan made, its ranges observed), finalized."""
    qat = copy.deepcopy(model).train()  # observers observe in training mode
    manager = ScheduledModifierManager.from_yaml(recipe)
    optimizer = manager.modify(qat, torch.optim.SGD(qat.parameters(), lr=0.0), steps_per_epoch=1)
    loss(qat, sample).backward()
    optimizer.step()
    manager.finalize(qat)
    return qat.eval()


def _decoder():
    import bench_llm

    torch.manual_seed(0)
    lm = bench_llm.build(6, 256).eval()
    sample = torch.randint(0, 256, (2, 128))
    qat = _qat(lm, DECODER_QAT, sample, lambda m, x: m(input_ids=x, labels=x).loss)
    return Logits(lm).eval(), Logits(qat).eval(), sample, ("ids", "logits"), (0, 1)


def _resnet18():
    torch.manual_seed(0)
    model = torch_init(ResNet18()).eval()
    sample = torch.randn(2, 3, 224, 224)
    qat = _qat(model, CNN_QAT, sample, lambda m, x: m(x).square().mean())
    return model, qat, sample, ("input", "output"), (0,)


MODELS = {"decoder": ("Llama-shaped decoder, 5.2 M (QAT: int4 weight-only)", _decoder),
          "resnet18": ("ResNet-18, 224 x 224 (QAT: W8A8)", _resnet18)}


def _torch_export(model, sample, names, axes, path: Path) -> None:
    shapes = ({axis: torch.export.Dim.DYNAMIC for axis in axes},)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(model, (sample,), str(path), dynamo=True, opset_version=18, input_names=[names[0]],
                          output_names=[names[1]], dynamic_shapes=shapes, verbose=False)


def _recal_export(model, sample, names, axes, path: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        export_onnx(model, sample, path, input_names=[names[0]], output_names=[names[1]],
                    dynamic_sequence=1 in axes)


def measure(key: str, rounds: int, folder: Path) -> dict:
    """Seconds of each export of model ``key``, ``rounds`` interleaved rounds after a warm-up of each."""
    label, build = MODELS[key]
    fp32, qat, sample, names, axes = build()
    variants = {"torch.onnx.export, float": lambda p: _torch_export(fp32, sample, names, axes, p),
                "recal export_onnx, float": lambda p: _recal_export(fp32, sample, names, axes, p),
                "recal export_onnx, QAT (QDQ)": lambda p: _recal_export(qat, sample, names, axes, p)}
    seconds: dict[str, list[float]] = {name: [] for name in variants}
    order = list(variants)
    for r in range(rounds + 1):  # round 0: the warm-up (the exporter's first use in the process), not kept
        for name in order[r % len(order):] + order[:r % len(order)]:
            path = folder / f"{key}-{len(seconds[name])}-{r}.onnx"
            start = time.perf_counter()
            variants[name](path)
            if r:
                seconds[name].append(time.perf_counter() - start)
            print(f"  {label}: {name}: {time.perf_counter() - start:.1f} s", flush=True)
    base = seconds["torch.onnx.export, float"]
    rows = []
    for name, values in seconds.items():
        ratios = [v / b for v, b in zip(values, base)]  # each round against torch's export in the same round
        rows.append({"model": label, "variant": name, "seconds": statistics.median(values),
                     "x_torch": statistics.median(ratios), "x_torch_low": min(ratios), "x_torch_high": max(ratios)})
    return {"rows": rows, "parameters": sum(p.numel() for p in fp32.parameters())}


def table(data: dict) -> str:
    """The docs' table of the saved runs (one per CPU)."""
    lines = ["| CPU | model | export | seconds | x torch's float export |", "|---|---|---|---:|---:|"]
    for run in data["runs"]:
        cpu = run["cpu"].split(",")[0].removeprefix("CPU: ")
        for row in run["rows"]:
            spread = f" ({row['x_torch_low']:.2f}-{row['x_torch_high']:.2f})" if row["variant"] != \
                "torch.onnx.export, float" else ""
            lines.append(f"| {cpu} | {row['model']} | {row['variant']} | {row['seconds']:.1f} | "
                         f"{row['x_torch']:.2f}{spread} |")
    notes = "; ".join(f"{run['cpu']}: torch {run['torch']}, {run['threads']} threads, medians of {run['rounds']} "
                      "interleaved rounds after a warm-up (per-round ratio, least-most in brackets)"
                      for run in data["runs"])
    return ("\n".join(lines) + f"\n\n{notes}. `python scripts/bench_export.py --json docs/results/export.json`.")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    parser.add_argument("--json", type=Path, help="also keep this CPU's run here")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error("--rounds must be at least 1 (round 0 is the warm-up, not kept)")
    torch.set_num_threads(args.threads)
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        for key in args.models:
            rows += measure(key, args.rounds, Path(folder))["rows"]
    run = {**machine(), "torch": torch.__version__, "threads": args.threads, "rounds": args.rounds, "rows": rows}
    print(table({"runs": [run]}))
    if args.json:
        save_run(args.json, run)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
