"""Other tools' QDQ files through ``quantize_qat_export``: what converts, how exactly, and how fast against the QDQ
file the user already has.

Sources, each a QDQ ONNX file as its tool writes it at its documented 8-bit settings:

- onnxruntime's ``quantize_static`` of full-width fp32 models built here (ResNet-18, ``scripts/bench/models.py``; Hugging
  Face's MobileNetV2 from its default config; random weights, nothing downloaded), exported by torch.onnx with its
  default fixed batch of 1, calibrated on 8 synthetic inputs (``peers.quantize_static``: ``quant_pre_process`` first):
  uint8 activations with int8 per-channel weights (onnxruntime's advice for CNNs), and int8 activations with
  per-tensor weights;
- onnxruntime's own 4-bit forms: ``quantize_static(weight_type=QInt4)`` of ResNet-18 (its ``com.microsoft`` Q/DQ,
  int4 weights per channel), and ``MatMulNBitsQuantizer`` in QDQ form (blocked int4, block 32) of a BERT encoder;
- ``quantize_static`` (uint8 activations, int8 weights per tensor; symmetric, and asymmetric: ``WeightSymmetric=False``)
  of Hugging Face's BERT (4 layers, hidden 256, from its config), exported at sequence length 128;
- the exports other tools wrote, committed under ``tests/fixtures/interop/`` with the script that made each
  (``scripts/interop_exports/``): every ``*.onnx`` there is a row (Brevitas's QONNX exports, which onnxruntime
  cannot run, and AIMET's float model with its ``.encodings`` beside it, timed as the QDQ model they mean: recal's
  reading of them).

Per file: the layers with a weight (Conv / Gemm / MatMul reading a constant) and those that stay float, the
verification's sample count and its op-by-op figure (every integer tensor against the QDQ file run as written), and
median latency at batch 1 on one thread, models interleaved round by round, each in three sessions of its own (see
``bench.timing``), of the QDQ file in a default onnxruntime session (its own QDQ fusion), recal's default output
(int8 weights) and, where written, its twin for x86 without VNNI (uint8 weights beyond +-64). The CPU is named:
which file is fast depends on it.

    python scripts/bench_interop.py [--quick] [--rounds 15] [--json docs/results/interop.json]

``--json`` keeps the runs of other CPUs in that file and replaces this CPU's: docs/interop.md shows each.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import warnings
from pathlib import Path

import numpy as np
import onnx
import torch

from bench.peers import matmul_nbits_qdq, quantize_static
from bench.results import machine, save_run, sessions_clause
from bench.suite import suite_module
from bench.timing import interleaved_latency
from recal_onnx import cpu, quantize_qat_export, read_as_qdq
from recal_onnx import generated_inputs
from bench.models import ResNet18, torch_init

ROOT = Path(__file__).resolve().parent.parent


FIXTURES = ROOT / "tests" / "fixtures" / "interop"
WEIGHTED = {"Conv", "Gemm", "MatMul", "ConvTranspose"}
# the same file converted with accuracy_level=4: MatMulNBits rounds its input to int8, as onnxruntime's own fusion
# of the file does (faster where int8 dot products are, no longer exact)
NBITS_ROUNDED = "ort MatMulNBits QDQ int4 block 32: hf-bert, accuracy_level=4"
OPTIONS = {NBITS_ROUNDED: {"accuracy_level": 4}}
SESSIONS = 3  # each file timed in this many sessions of its own (bench.timing.interleaved_latency)
# between a weight's constant and its layer: quantizing it (NNCF, ModelOpt), clipping its integers (Brevitas), moving it
MOVES_WEIGHT = {"QuantizeLinear", "DequantizeLinear", "Clip", "Cast", "Transpose", "Reshape", "Identity"}


def hf_mobilenet_v2() -> torch.nn.Module:
    """Hugging Face's MobileNetV2 at its default config, with torch's own initialisation: transformers draws its
    BatchNorm scales near 0 and every activation of the random net vanishes (logits spanning 2e-22)."""
    import transformers

    HF = suite_module("tests.e2e.zoo.test_cnns").HF  # the zoo's logits wrapper

    return torch_init(HF(transformers.MobileNetV2ForImageClassification(transformers.MobileNetV2Config())))


FP32 = {"resnet18": lambda: ResNet18(1000), "hf-mobilenet-v2": hf_mobilenet_v2}
# label -> quantize_static settings: (activation type, per channel)
STATIC = {"ort static u8/s8 per-channel": ("QUInt8", True), "ort static s8/s8 per-tensor": ("QInt8", False)}
BERT_TOKENS = 128


def hf_bert(folder: Path) -> Path:
    """Hugging Face's BERT encoder (4 layers, hidden 256, 4 heads) from its config, biases drawn as a trained model's
    are (torch's exporter shares equal initializers), exported by torch.onnx at batch 1 and 128 tokens."""
    import transformers

    torch.manual_seed(0)
    config = transformers.BertConfig(hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                                     intermediate_size=1024)
    model = transformers.BertModel(config, add_pooling_layer=False).eval()
    for name, p in model.named_parameters():
        if name.endswith("bias"):
            torch.nn.init.normal_(p, std=0.02)
    path = folder / "hf-bert.fp32.onnx"

    class Encoder(torch.nn.Module):  # token ids in, hidden states out
        def __init__(self):
            super().__init__()
            self.bert = model

        def forward(self, input_ids):
            return self.bert(input_ids=input_ids).last_hidden_state

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(Encoder().eval(), (torch.randint(0, config.vocab_size, (1, BERT_TOKENS)),), path,
                          dynamo=False,
                          input_names=["input_ids"], output_names=["last_hidden_state"])
    return path


def onnxruntime_forms(folder: Path, size: int) -> dict[str, Path]:
    """onnxruntime's BERT (8-bit static) and 4-bit forms (int4 per channel, blocked int4 MatMul weights)."""
    found = {}
    bert = hf_bert(folder)
    rng = np.random.default_rng(0)
    tokens = [{"input_ids": rng.integers(0, 30522, (1, BERT_TOKENS)).astype(np.int64)} for _ in range(8)]
    quantize_static(bert, folder / "hf-bert.static.onnx", tokens, per_channel=False)
    found["ort static u8/s8: hf-bert"] = folder / "hf-bert.static.onnx"
    quantize_static(bert, folder / "hf-bert.asym.onnx", tokens, per_channel=False,
                    extra_options={"WeightSymmetric": False})
    found["ort static u8/s8 asymmetric weights: hf-bert"] = folder / "hf-bert.asym.onnx"
    resnet = folder / "resnet18.fp32.onnx"
    calibration = [{"input": rng.standard_normal((1, 3, size, size)).astype(np.float32)} for _ in range(8)]
    quantize_static(resnet, folder / "resnet18.int4.onnx", calibration, weight_type="QInt4")
    found["ort static u8/s4 per-channel: resnet18"] = folder / "resnet18.int4.onnx"
    opset21 = onnx.version_converter.convert_version(onnx.load(str(bert)), 21)
    onnx.save(opset21, str(folder / "hf-bert.fp32.21.onnx"))
    matmul_nbits_qdq(folder / "hf-bert.fp32.21.onnx", folder / "hf-bert.nbits.onnx")
    found["ort MatMulNBits QDQ int4 block 32: hf-bert"] = folder / "hf-bert.nbits.onnx"
    found[NBITS_ROUNDED] = folder / "hf-bert.nbits.onnx"
    return found


def sources(folder: Path, size: int, models: list[str]) -> dict[str, Path]:
    """Every QDQ file to convert, by row label."""
    found = {}
    for name in models:
        torch.manual_seed(0)
        fp32 = folder / f"{name}.fp32.onnx"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.onnx.export(FP32[name]().eval(), torch.randn(1, 3, size, size), fp32, dynamo=False,
                              input_names=["input"])
        rng = np.random.default_rng(0)
        calibration = [{"input": rng.standard_normal((1, 3, size, size)).astype(np.float32)} for _ in range(8)]
        for label, (activation, per_channel) in STATIC.items():
            path = folder / f"{name}.{activation}.{per_channel}.onnx"
            quantize_static(fp32, path, calibration, activation_type=activation, per_channel=per_channel)
            found[f"{label}: {name}"] = path
    if "resnet18" in models:
        found.update(onnxruntime_forms(folder, size))
    for path in sorted(FIXTURES.glob("*.onnx")) if FIXTURES.is_dir() else []:
        found[path.stem] = path
    return found


def weighted_layers(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    """The Conv / Gemm / MatMul nodes that read a constant weight (through :data:`MOVES_WEIGHT`), not two
    activations (an attention's products)."""
    made = {o: n for n in model.graph.node for o in n.output}
    constants = {t.name for t in model.graph.initializer}

    def constant(name: str) -> bool:
        node = made.get(name)
        if node is None:
            return name in constants
        return node.op_type == "Constant" or node.op_type in MOVES_WEIGHT and constant(node.input[0])

    return [n for n in model.graph.node if n.op_type in WEIGHTED and len(n.input) > 1 and constant(n.input[1])]


def row(label: str, qdq: Path, folder: Path, rounds: int) -> dict:
    out = folder / (label.replace(" ", "_").replace(":", "").replace("/", "-") + ".int8.onnx")
    encodings = qdq.with_suffix(".encodings") if qdq.with_suffix(".encodings").exists() else None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = quantize_qat_export(str(qdq), out, encodings=encodings, **OPTIONS.get(label, {}))
    model = onnx.load(str(qdq))
    read = read_as_qdq(model, encodings)
    if read is not model:  # QONNX, AIMET's float model and encodings: the QDQ file timed is the one they mean
        model, qdq = read, folder / f"{qdq.stem}.qdq.onnx"
        onnx.save(model, qdq)
    feed = generated_inputs(model, batch=1, seed=1)
    paths = {"qdq": qdq, "recal": out, **({"recal avx2": result.avx2_path} if result.avx2_path else {})}
    ms = interleaved_latency(paths, feed, rounds, per_round=1, min_seconds=0.02, sessions=SESSIONS)
    v = result.verification
    return {"source": label, "layers": len(weighted_layers(model)),
            "float_layers": len(weighted_layers(result.model)), "float_reasons": result.float_reasons,
            "samples": v.samples, "local_steps": v.local_steps, "local_share": v.local_share,
            "max_steps": v.max_steps, "agreement": v.argmax_agreement, "latency": ms,
            "max_abs_diff": v.max_abs_diff, "output_range": v.output_range,
            "weights": result.weights_note}


def table(data: dict) -> str:
    """docs/interop.md's table: every run in ``data`` (one per CPU), each under the CPU it ran on."""
    parts = []
    for run in data["runs"]:
        versions = f"onnxruntime {run['onnxruntime']}, torch {run['torch']}, python {run['python']}"
        parts.append(f"{run['cpu']}; {versions}; batch 1, 1 thread, median of {run['rounds']} interleaved rounds"
                     f"{sessions_clause(run)}, quantize_static rows at {run['size']}x{run['size']} "
                     "(`python scripts/bench_interop.py --json docs/results/interop.json`)\n\n"
                     + format_rows(run["rows"]))
    return "\n\n".join(parts)


def format_rows(rows: list[dict]) -> str:
    lines = ["| QDQ file | layers | left float | verified on | op by op | argmax agreement | QDQ file (ms) | recal "
             "(ms) | x QDQ file | recal avx2 twin (ms) |", "|---" * 10 + "|"]
    for r in rows:
        ms = r["latency"]
        twin = f"{ms['recal avx2']:.2f}" if "recal avx2" in ms else "none (within +-64)"
        agreement = f"{r['agreement']:.4f}" if r["agreement"] is not None else "-"
        exact = (f"<= {r['local_steps']} step(s), {r['local_share']:.1e} differ" if r["local_steps"] is not None
                 else f"no integer activation; output within {r['max_abs_diff'] / max(r['output_range'], 1e-30):.1e}"
                 " of its range")
        lines.append(f"| {r['source']} | {r['layers']} | {r['float_layers']} | {r['samples']} | "
                     f"{exact} | {agreement} | {ms['qdq']:.2f} | "
                     f"{ms['recal']:.2f} | {ms['qdq'] / ms['recal']:.2f}x | {twin} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3 rounds, 64x64 inputs")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--models", nargs="+", choices=list(FP32), default=list(FP32))
    parser.add_argument("--json", type=Path, help="also write the rows here (docs/results/interop.json)")
    args = parser.parse_args(argv)
    rounds, size = (3, 64) if args.quick else (args.rounds, args.size)
    torch.set_num_threads(1)
    header = (f"{cpu.describe()}\nbatch 1, 1 thread, median of {rounds} interleaved rounds; quantize_static rows at "
              f"{size}x{size}; recal: quantize_qat_export at its defaults (target any)")
    print(header, flush=True)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for label, path in sources(Path(tmp), size, args.models).items():
            rows.append(row(label, path, Path(tmp), rounds))
            print(format_rows(rows[-1:]).splitlines()[-1], flush=True)
    print(format_rows(rows))
    if args.json:  # one run per CPU: a run on another CPU is kept beside this one
        save_run(args.json, {**machine(), "size": size, "rounds": rounds, "sessions": SESSIONS, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
