"""The CNN zoo on onnxruntime: fp32 vs recal's int8 (``qoperator`` with int8 or uint8 weights, ``qdq``) vs
onnxruntime's ``quantize_static``.

The models of ``tests/e2e/zoo/test_cnns.py`` (Hugging Face ResNet, MobileNetV2, EfficientNet, ConvNeXt from small
configs; torchvision-style ResNet / MobileNetV2 / Inception blocks) and three full-width ones, ResNet-18
(``scripts/zoo.py``), Hugging Face's default ResNet-50 and MobileViT-small; random weights, nothing downloaded. Each is pruned 80% and
QAT-trained for a few steps on synthetic 32x32 data, exported at ``--size`` (QDQ) and converted by
``quantize_qat_export`` (the 7-bit net at the defaults, both formats; the 8-bit net as the two files target
``any`` writes, int8 weights and their uint8 twin for x86 without VNNI); the float model (same
seed, not trained) is exported and quantized by onnxruntime's ``quantize_static`` (QDQ, uint8 activations,
int8 per-channel weights, after ``quant_pre_process``, calibrated on 8 synthetic inputs).

One table: median latency at batch 1, 1 thread (every model in turn, round after round, each round in fresh
sessions and three samples of at least 50 ms of runs), the speed-up of
recal's model for this CPU (``weight_type="auto"``: int8 weights with VNNI / AMX, uint8 without) over fp32 and
over ``quantize_static``, sizes, the float ops left in recal's ``qoperator`` model (by design or not) and
fidelity: the largest difference of the logits from the QAT export run as float QDQ (optimizations off) on
64 inputs, as a share of the logits' range, and argmax agreement, for recal's int8 and for onnxruntime's own
int8 execution of that same QDQ export. Run it on an idle machine: it measures latency.

    python scripts/bench_zoo.py [--quick] [--rounds 15] [--size 224] [--models resnet18 hf-resnet-basic ...]
        [--json docs/results/zoo.json [--merge]]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import warnings
from pathlib import Path

import numpy as np
import torch

from bench.peers import STATIC, STATIC_REDUCED, fidelity, static_peers
from bench.results import load, machine, save
from bench.timing import in_turns, repeated, spread
from recal_onnx import cpu, quantize_qat_export
from recal_torch import export_onnx
from bench.suite import suite_module
from bench.models import ResNet18, torch_init

ROOT = Path(__file__).resolve().parent.parent


_zoo = suite_module("tests.e2e.zoo.test_cnns")  # the zoo test's models and recipe
CLASSES, HF, MODELS, prune_and_qat = _zoo.CLASSES, _zoo.HF, _zoo.MODELS, _zoo.prune_and_qat


def hf_resnet50() -> torch.nn.Module:
    import transformers

    return HF(transformers.ResNetForImageClassification(transformers.ResNetConfig(num_labels=CLASSES)))


def hf_mobilevit() -> torch.nn.Module:
    """MobileViT-small at its default config (convolutions, SiLUs, transformer blocks), torch-initialised
    (:func:`bench.models.torch_init`)."""
    import transformers

    return torch_init(HF(transformers.MobileViTForImageClassification(transformers.MobileViTConfig(
        num_labels=CLASSES))))


TIMING = "in turns"  # bench.timing.in_turns: every model in turn, round after round, each round in fresh sessions
BUILDERS = {"resnet18": lambda: ResNet18(CLASSES), "hf-resnet50": hf_resnet50, "hf-mobilevit": hf_mobilevit,
            **{name: m[0] for name, m in MODELS.items()}}
# recal's default (target any: 7-bit QAT weights stay int8), its QDQ form, and the two files target any writes for
# the same network trained without reduce_range (8-bit weights): the int8 model (for VNNI / AMX and Arm) and its
# uint8-weight twin for x86 without VNNI (what target x86-avx2 writes alone)
RECAL = {"recal": ("qoperator", "any", True), "recal qdq": ("qdq", "any", True),
         "recal 8-bit int8": ("qoperator", "x86-vnni", False), "recal 8-bit uint8": ("qoperator", "x86-avx2", False)}


def build(name: str, size: int, folder: Path) -> dict:
    """Every file of one model's row (fp32, recal's four, onnxruntime's two), its feed and fidelity; timed later,
    with the other models' (:func:`bench.timing.in_turns`)."""
    folder.mkdir()
    sample = torch.randn(1, 3, size, size)
    torch.manual_seed(0)
    fp32 = export_onnx(BUILDERS[name]().eval(), sample, folder / "fp32.onnx", dynamo=False)
    qats = {reduced: export_onnx(prune_and_qat(name, BUILDERS[name], reduce_range=reduced), sample,
                                 folder / f"qat{'7' if reduced else '8'}.onnx", dynamo=False) for reduced in (True, False)}
    rng = np.random.default_rng(0)
    checks = {"input": rng.standard_normal((64, 3, size, size)).astype(np.float32)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        recal = {label: quantize_qat_export(str(qats[reduced]), folder / f"{label}.onnx", format=fmt, target=target,
                                            verify_inputs=checks, tolerance=float("inf"))
                 for label, (fmt, target, reduced) in RECAL.items()}
    calibration = [{"input": rng.standard_normal((1, 3, size, size)).astype(np.float32)} for _ in range(8)]
    paths = {"fp32": fp32, **{label: folder / f"{label}.onnx" for label in RECAL},
             **static_peers(fp32, folder, calibration)}
    agree = {label: fidelity(paths[label], qats[RECAL[label][2]], checks) for label in ("recal", "recal qdq")}
    agree.update({label: fidelity(paths[label], fp32, checks) for label in (STATIC, STATIC_REDUCED)})
    agree["qat export"] = fidelity(qats[True], qats[True], checks)  # the QDQ export itself in a default session
    return {"paths": paths, "feed": {"input": sample.numpy()}, "sizes": {k: p.stat().st_size for k, p in paths.items()},
            "float_ops": recal["recal"].float_ops, "agree": agree}


def bench(models: list[str], size: int, rounds: int, folder: Path, repeats: int = 3) -> dict[str, dict]:
    """Each model's row: built one after another, then timed in turns, round after round, the whole timing repeated
    ``repeats`` times (:func:`bench.timing.repeated`). Three samples a round, each at least 50 ms of runs: with one
    20 ms sample a round, two files whose optimized graphs are identical (recal's qoperator and qdq ResNet-50)
    differed by 17% on a shared machine. A row's latency is each file's median over the repeats' medians; its
    ``ratios`` keep every repeat's speed-up of recal over each other file."""
    built = {}
    for name in models:
        built[name] = build(name, size, folder / name)
        print(f"  {name}: built", flush=True)
    groups = {name: (b["paths"], b["feed"]) for name, b in built.items()}
    runs = repeated(lambda: in_turns(groups, rounds, per_round=3, min_seconds=0.05), repeats)
    rows = {}
    for name, b in built.items():
        latency = {k: statistics.median(run[name][k] for run in runs) for k in b["paths"]}
        ratios = {k: [run[name][k] / run[name]["recal"] for run in runs] for k in b["paths"] if k != "recal"}
        rows[name] = {"latency": latency, "ratios": ratios, **{k: v for k, v in b.items() if k not in ("paths", "feed")}}
    return rows


def _spread(row: dict, other: str) -> str:
    """recal's speed-up over ``other``: the median of the repeats, and their least and most."""
    low, mid, high = spread(row["ratios"][other])
    return f"{mid:.2f}x ({low:.2f}-{high:.2f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3 rounds, 64x64 inputs, the small models")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--repeats", type=int, default=3, help="whole interleaved timings, each ratio's spread kept")
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--models", nargs="+", choices=list(BUILDERS))
    parser.add_argument("--json", type=Path, help="also write the rows here")
    parser.add_argument("--merge", action="store_true",
                        help="with --json: replace or add these models' rows in that file, keep the others")
    args = parser.parse_args()
    rounds, size = (3, 64) if args.quick else (args.rounds, args.size)
    repeats = 1 if args.quick else args.repeats
    models = args.models or list(MODELS if args.quick else BUILDERS)
    torch.set_num_threads(1)
    print(f"{cpu.describe()}\nbatch 1, 1 thread, {size}x{size}, median of {rounds} interleaved rounds (ms); sizes in "
          "KB (1024 B); 'recal' = the default: 7-bit QAT (reduce_range), target any; '8-bit int8 / uint8' = the same "
          "net trained with 8-bit weights: the two files target any writes (int8 weights; their uint8 twin for x86 "
          "without VNNI); "
          "fidelity on 64 inputs, default onnxruntime session against the model it was made from run as written "
          "(recal: its QAT export; onnxruntime: fp32): argmax agreement, max |difference| as % of the range")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        measured = bench(models, size, rounds, Path(tmp), repeats)
        print("| model | fp32 | recal | recal qdq | recal 8-bit int8 | recal 8-bit uint8 | ort static | ort static rr | "
              "recal vs fp32 | recal vs static | recal vs static rr | size fp32 / recal / static | float ops left | "
              "QAT export (default session) | recal | ort static | ort static rr |")
        print("|---" * 17 + "|")
        for name, r in measured.items():
            rows.append({"model": name, **r})
            ms, kb, a = r["latency"], {k: v / 1024 for k, v in r["sizes"].items()}, r["agree"]
            left = ", ".join(f"{op} x{n}" for op, n in r["float_ops"].items()) or "none"
            cell = lambda label: f"{a[label][0]:.3f}, {100 * a[label][1]:.2f}%"  # noqa: E731
            print(f"| {name} | {ms['fp32']:.2f} | {ms['recal']:.2f} | {ms['recal qdq']:.2f} | "
                  f"{ms['recal 8-bit int8']:.2f} | {ms['recal 8-bit uint8']:.2f} | {ms[STATIC]:.2f} | "
                  f"{ms[STATIC_REDUCED]:.2f} | {ms['fp32'] / ms['recal']:.2f}x | {_spread(r, STATIC)} | "
                  f"{_spread(r, STATIC_REDUCED)} | {kb['fp32']:.0f} / {kb['recal']:.0f} / {kb[STATIC]:.0f} | "
                  f"{left} | {cell('qat export')} | {cell('recal')} | {cell(STATIC)} | {cell(STATIC_REDUCED)} |",
                  flush=True)
    if args.json:
        if args.merge and args.json.exists():
            kept = load(args.json)
            if (kept["cpu"], kept["size"], kept["rounds"], kept.get("timing"), kept.get("repeats", 1)) != (
                    cpu.describe(), size, rounds, TIMING, repeats):
                raise SystemExit(f"{args.json} was measured on another CPU, size or rounds: rerun every model")
            new = {row["model"]: row for row in rows}
            order = list(BUILDERS)
            rows = sorted([*(r for r in kept["rows"] if r["model"] not in new), *new.values()],
                          key=lambda r: order.index(r["model"]) if r["model"] in order else len(order))
        save(args.json, {**machine(), "size": size, "rounds": rounds, "repeats": repeats, "timing": TIMING,
                         "rows": rows})


if __name__ == "__main__":
    main()
