r"""A decoder LM in 4 bits on real text: fp32, onnxruntime's int4 post-training quantizers, recal's int4 QAT.

A small Llama-shaped decoder (a Hugging Face config, random initial weights; bytes as tokens) learns the Python
standard library's own source, which every machine has offline: its ``.py`` files are split into train and test by a
hash of their path, so no test file is seen in training. The fp32 model trains ``--steps``; every int4 model then
has the same training budget as the baseline, the fp32 model trained on for ``--qat-steps`` at the QAT's LR:

- onnxruntime's int4 weight-only quantizers (``MatMulNBitsQuantizer``) on the baseline's ONNX model, each at block
  size = recal's group size: RTN symmetric and asymmetric (its default), HQQ, and GPTQ when its tools run here;
- recal int4 without training, on the baseline (the QAT model's grid at its first step: recal's round-to-nearest);
- recal int4 QAT (``scheme`` int4 per group, activations float) for ``--qat-steps`` from the fp32 model, with the
  minmax and the mse observer and with learned scales (lsq, from the mse fit; and lsq again with half its loss
  distilled from the fp32 model trained on, the one onnxruntime's rows quantize), exported and converted to
  ``MatMulNBits`` by ``quantize_qat_export``; the last once more at ``accuracy_level=4`` (the input quantized to
  int8 per block: onnxruntime's fast kernel, not exact).

Each row: test perplexity (the ONNX model in a default onnxruntime session, next-token cross-entropy over the test
windows), file size, and latency on one thread (batch 1; a 128-token prompt, and one token: a decode step of the
``use_cache=False`` export), medians of interleaved rounds. ``recovered``: the share of the perplexity onnxruntime's
default RTN loses against the baseline that the row wins back, ``(ppl_rtn - ppl) / (ppl_rtn - ppl_baseline)``.

``--ternary REGEX`` puts the layers whose parameter names match at 2 bits (ternary in recal: ``num_bits: 2``; 2-bit
RTN and HQQ in onnxruntime's rows; its GPTQ writes 4 bits only), the rest at 4: a setting where round-to-nearest
loses far more than at 4 bits alone.

    python scripts/bench_llm.py [--steps 800] [--qat-steps 300] [--group 32] [--ternary 'mlp\.(gate|up)_proj']
                                [--seeds 0 1 2] [--json docs/results/llm.json]
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import math
import os
import shlex
import sys
import sysconfig
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import torch
import torch.nn.functional as F
from torch import nn

from recal_onnx import cpu, quantize_qat_export
from recal_onnx import session
from recal_torch import ScheduledModifierManager, export_onnx

from examples.int4_decoder import Logits  # ids -> logits, no KV cache
from bench.timing import interleaved_latency
from bench.results import machine, save

SEQ = 128

LR_RECIPE = """
- !LearningRateFunctionModifier {{start_epoch: 0, end_epoch: 1, lr_func: cosine, init_lr: {lr}, final_lr: {final_lr}}}
"""
QAT_RECIPE = LR_RECIPE + """
- !QuantizationModifier
  start_epoch: 0
  scheme:
    input_activations: null
    weights: {{num_bits: 4, symmetric: true, {grouping}, observer: {observer}}}
"""
TERNARY_OVERRIDE = """\
  scheme_overrides:
    're:.*(?:{pattern}).*': {{input_activations: null, weights: {{num_bits: 2, {grouping}, observer: {observer}}}}}
"""
DISTILL_RECIPE = """
- !DistillationModifier {start_epoch: 0, end_epoch: 1, hardness: 0.5, temperature: 1.0}
"""  # half the loss from the text, half from the fp32 model trained on (the teacher onnxruntime's rows quantize)


def corpus(train_bytes: int, test_bytes: int) -> tuple[np.ndarray, np.ndarray, int]:
    """The standard library's ``.py`` files as bytes: train and test split by file (1 in 10 by path hash)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    train, test = bytearray(), bytearray()
    files = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts)
    for path in files:
        rel = path.relative_to(root).as_posix()
        part = test if hashlib.sha256(rel.encode()).digest()[0] % 10 == 0 else train
        limit = test_bytes if part is test else train_bytes
        if len(part) < limit:
            part += path.read_bytes()[: limit - len(part)] + b"\n\n"
    return np.frombuffer(bytes(train), np.uint8), np.frombuffer(bytes(test), np.uint8), len(files)


ARCHS = {"llama": "Llama-shaped", "gpt-neox": "GPT-NeoX-shaped (Pythia's layout)"}


def build(layers: int, hidden: int, ffn: int | None = None, arch: str = "llama") -> nn.Module:
    """A decoder over bytes, heads of 64: Llama-shaped (a gated MLP ``ffn`` wide, 3 x ``hidden`` unless given) or
    GPT-NeoX-shaped as Pythia is (Q, K and V packed per head, a quarter of each head rotary, parallel residual, a
    GELU MLP 4 x ``hidden`` wide unless given)."""
    import transformers

    if arch == "gpt-neox":
        config = transformers.GPTNeoXConfig(vocab_size=256, hidden_size=hidden, intermediate_size=ffn or 4 * hidden,
                                            num_hidden_layers=layers, num_attention_heads=hidden // 64,
                                            rotary_pct=0.25, max_position_embeddings=2 * SEQ,
                                            tie_word_embeddings=False, hidden_dropout=0.0, attention_dropout=0.0)
        return transformers.GPTNeoXForCausalLM(config)
    ffn = ffn or 3 * hidden
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=hidden, intermediate_size=ffn,
                                      num_hidden_layers=layers, num_attention_heads=hidden // 64,
                                      num_key_value_heads=hidden // 64, max_position_embeddings=2 * SEQ,
                                      tie_word_embeddings=False)
    return transformers.LlamaForCausalLM(config)


def drop_exporter_record(path: Path) -> Path:
    """The fp32 file without the torch exporter's per-node record, as recal's converter writes its own: onnxruntime's
    quantizers copy it into theirs, and the files' sizes then compare the models, not the record."""
    model = onnx.load(str(path))
    for node in model.graph.node:  # the exporter's is the only per-node record in an fp32 export
        del node.metadata_props[:]
    onnx.save(model, str(path))
    return path


def batches(data: np.ndarray, batch: int, seed: int):
    g = np.random.default_rng(seed)
    while True:
        starts = g.integers(0, len(data) - SEQ - 1, batch)
        window = torch.from_numpy(np.stack([data[s:s + SEQ + 1] for s in starts]).astype(np.int64))
        yield window[:, :-1], window[:, 1:]


def train(model: nn.Module, data: np.ndarray, steps: int, lr: float, batch: int, seed: int,
          manager: ScheduledModifierManager | None = None, teacher: nn.Module | None = None) -> float:
    """AdamW on next-token loss; the LR warms up then follows a cosine (or the recipe's, under ``manager``, which
    blends in distillation from ``teacher`` when its recipe says)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    if manager is not None:
        optimizer = manager.modify(model, optimizer, steps_per_epoch=steps,
                                   teacher=None if teacher is None else Logits(teacher))
    model.train()
    t0, loss = time.perf_counter(), float("nan")
    for step, (x, y) in zip(range(steps), batches(data, batch, seed)):
        if manager is None:
            warm = min(1.0, (step + 1) / 50)
            for group in optimizer.param_groups:
                group["lr"] = lr * warm * (0.1 + 0.45 * (1 + math.cos(math.pi * step / steps)))
        optimizer.zero_grad()
        out = model(input_ids=x, use_cache=False).logits
        loss_t = F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))
        if manager is not None:
            loss_t = manager.loss(loss_t, x, out)
        loss_t.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        loss = float(loss_t)
        if step % max(1, steps // 5) == 0 or step == steps - 1:
            print(f"    step {step:4d}  loss {loss:.3f}  {time.perf_counter() - t0:6.0f}s", flush=True)
    if manager is not None:
        manager.finalize(model)
    return loss


def perplexity(path: Path, windows: np.ndarray) -> float:
    s = session(str(path), 2)
    nll, count = 0.0, 0
    for chunk in np.array_split(windows, max(1, len(windows) // 8)):
        logits = s.run(None, {"ids": chunk[:, :-1].astype(np.int64)})[0].astype(np.float64)
        logits -= logits.max(-1, keepdims=True)
        logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
        nll -= np.take_along_axis(logp, chunk[:, 1:, None].astype(np.int64), -1).sum()
        count += chunk[:, 1:].size
    return float(math.exp(nll / count))


def linear_nodes(path: Path, model: nn.Module, pattern: str) -> set[str]:
    """The names of the MatMul nodes of the ONNX model at ``path`` that multiply by a Linear weight of ``model``
    whose parameter name matches ``pattern`` (found by value: the exporter names nodes its own way)."""
    import re

    from onnx import numpy_helper

    wanted = [p.detach().numpy().T for n, p in model.named_parameters() if p.dim() == 2 and re.search(pattern, n)]
    graph = onnx.load(str(path)).graph
    consts = {t.name: t for t in graph.initializer}
    found = set()
    for node in graph.node:
        if node.op_type == "MatMul" and node.input[1] in consts:
            value = numpy_helper.to_array(consts[node.input[1]])
            if any(w.shape == value.shape and np.array_equal(w, value) for w in wanted):
                found.add(node.name)
    if len(found) != len(wanted):
        raise SystemExit(f"--ternary {pattern!r}: {len(wanted)} weights match, {len(found)} MatMul nodes read them")
    return found


def ort_int4(fp32: Path, folder: Path, group: int, calibration: list[dict[str, np.ndarray]],
             two_bit: set[str] = frozenset()) -> dict[str, tuple]:
    """onnxruntime's own int4 weight-only quantizers on the fp32 model (the ``two_bit`` MatMul nodes at 2 bits):
    (path, seconds) or (None, why)."""
    from onnxruntime.quantization import CalibrationDataReader
    from onnxruntime.quantization import matmul_nbits_quantizer as nbits

    class Reader(CalibrationDataReader):
        def __init__(self):
            self.feeds = iter(calibration)

        def get_next(self):
            return next(self.feeds, None)

    configs = {
        "ort RTN asymmetric (default)": lambda bits: nbits.DefaultWeightOnlyQuantConfig(block_size=group,
                                                                                        is_symmetric=False, bits=bits),
        "ort RTN symmetric": lambda bits: nbits.DefaultWeightOnlyQuantConfig(block_size=group, is_symmetric=True,
                                                                             bits=bits),
        "ort HQQ": lambda bits: nbits.HQQWeightOnlyQuantConfig(block_size=group, bits=bits),
        "ort GPTQ": lambda bits: nbits.GPTQWeightOnlyQuantConfig(calibration_data_reader=Reader(), block_size=group),
    }
    out = {}
    for label, config in configs.items():
        target = folder / (label.split(" (")[0].replace(" ", "_") + ".onnx")
        t0 = time.perf_counter()
        symmetric = "symmetric" in label and "asym" not in label
        try:
            model = onnx.load(str(fp32))
            if "GPTQ" in label and two_bit:
                raise NotImplementedError("onnxruntime's GPTQ writes 4 bits only (it leaves a node asked for in 2 "
                                          "bits float)")
            if "GPTQ" in label:
                passes = [(4, config(4), [])]
            else:  # the 2-bit nodes first (every other node excluded), then the rest (those are MatMulNBits by then)
                others = [n.name for n in model.graph.node if n.name not in two_bit]
                passes = ([(2, config(2), others)] if two_bit else []) + [(4, config(4), [])]
            for bits, algo, exclude in passes:
                quantizer = nbits.MatMulNBitsQuantizer(model, bits=bits, block_size=group, is_symmetric=symmetric,
                                                       nodes_to_exclude=exclude, algo_config=algo)
                quantizer.process()
                model = quantizer.model.model
            if two_bit and sorted(a.i for n in model.graph.node if n.op_type == "MatMulNBits" for a in n.attribute
                                  if a.name == "bits").count(2) != len(two_bit):
                raise RuntimeError(f"the {len(two_bit)} 2-bit layers asked for were not all written in 2 bits")
            onnx.save(model, str(target))
            out[label] = (target, time.perf_counter() - t0)
        except Exception as exc:  # noqa: BLE001 - a peer's tool that does not run here is a row that says why
            out[label] = (None, f"{type(exc).__name__}: {' '.join(str(exc).split())[:160]}")
    return out


def recal_int4(fp32_model: nn.Module, data: np.ndarray, steps: int, observer: str, args, folder: Path,
               sample: torch.Tensor, label: str, teacher: nn.Module | None = None, seed: int = 0) -> tuple[Path, float]:
    """QAT from the fp32 model for ``steps`` (0: the grid alone; with ``teacher``: distilling its outputs too),
    exported and converted; (path, seconds)."""
    model = copy.deepcopy(fp32_model)
    lr = args.qat_lr if steps else 0.0  # no QAT: one step at LR 0 sets the grid and changes no weight
    grouping = f"strategy: group, group_size: {args.group}" if args.group else "strategy: channel"
    recipe = QAT_RECIPE.format(grouping=grouping, observer=observer, lr=lr, final_lr=lr / 10)
    if args.ternary:
        recipe += TERNARY_OVERRIDE.format(pattern=args.ternary, grouping=grouping, observer=observer)
    manager = ScheduledModifierManager.from_yaml(recipe + (DISTILL_RECIPE if teacher is not None else ""))
    t0 = time.perf_counter()
    train(model, data, max(steps, 1), lr, args.batch, seed=10 * seed + 1, manager=manager,
          teacher=None if teacher is None else copy.deepcopy(teacher))
    qat = folder / f"{label}.qat.onnx"
    export_onnx(Logits(model).eval(), sample, qat, input_names=["ids"], output_names=["logits"],
                dynamic_sequence=True)
    target = folder / f"{label}.onnx"
    result = quantize_qat_export(str(qat), target, inputs={"ids": sample.numpy()})
    print(f"    {label}: {sum(n.op_type == 'MatMulNBits' for n in result.model.graph.node)} MatMulNBits, "
          f"verification {result.verification}", flush=True)
    return target, time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=800, help="fp32 training steps")
    parser.add_argument("--qat-steps", type=int, default=300)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--qat-lr", type=float, default=2e-4)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--ffn", type=int, help="the MLP's width (default: 3 x hidden)")
    parser.add_argument("--group", type=int, default=32, help="int4 group size; 0: one scale per output channel")
    parser.add_argument("--ternary", metavar="REGEX", help="layers (parameter names) at 2 bits, the rest at 4")
    parser.add_argument("--train-mb", type=float, default=8.0)
    parser.add_argument("--test-windows", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--json", type=Path, help="also write the table here (docs/results/llm.json)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0],
                        help="one whole run a seed (model init, training data order, onnxruntime's calibration "
                             "windows); the table gives each figure's median and, over several, its range")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    runs = [run_seed(args, seed) for seed in args.seeds]
    meta, tables = runs[0][0], [table for _, table in runs]
    rows = [{"label": row["label"], **({"note": row["note"]} if "note" in row else {
        key: [t[i][key] for t in tables] for key in ("ppl", "recovered", "bytes", "ms_prompt", "ms_token")})}
        for i, row in enumerate(tables[0])]
    if len(args.seeds) > 1:
        print(f"\nover seeds {' '.join(map(str, args.seeds))}: recovered, median (least-most)")
        for row in rows:
            shares = [r for r in row.get("recovered", []) if r is not None]
            if shares:
                print(f"{row['label']:40s} {np.median(shares):6.2f} ({min(shares):.2f}-{max(shares):.2f})")
    if args.json:
        save(args.json, {**machine(), **meta, "seeds": args.seeds, "rows": rows,
                         "command": shlex.join(["python", "scripts/bench_llm.py", *sys.argv[1:]])})


def run_seed(args, seed: int) -> tuple[dict, list[dict]]:
    """One whole run with ``seed``: the settings it ran with and its rows (each model's figures)."""
    torch.manual_seed(seed)
    folder = Path(tempfile.mkdtemp(prefix="recal-bench-llm-"))
    train_data, test_data, files = corpus(int(args.train_mb * 1e6), (args.test_windows + 1) * (SEQ + 1))
    windows = np.stack([test_data[i * (SEQ + 1):(i + 1) * (SEQ + 1)] for i in range(args.test_windows)])
    args.ffn = args.ffn or 3 * args.hidden
    model = build(args.layers, args.hidden, args.ffn)
    params = sum(p.numel() for p in model.parameters())
    print(f"{files} stdlib files: {len(train_data) / 1e6:.1f} MB train, {windows.size / 1e3:.0f} KB test; "
          f"Llama-shaped decoder, {params / 1e6:.2f} M parameters", flush=True)
    print(f"  fp32: {args.steps} steps, batch {args.batch} x {SEQ}", flush=True)
    train(model, train_data, args.steps, args.lr, args.batch, seed=10 * seed)
    model.eval()
    sample = torch.from_numpy(windows[:2, :SEQ].astype(np.int64))
    fp32 = folder / "fp32.onnx"
    export_onnx(Logits(model), sample, fp32, input_names=["ids"], output_names=["logits"], dynamic_sequence=True)
    drop_exporter_record(fp32)
    rows: dict[str, dict] = {f"fp32, {args.steps} steps": {"path": fp32, "seconds": None}}
    print(f"  fp32 trained on for {args.qat_steps} steps at the QAT's LR: the baseline with the QAT's training",
          flush=True)
    more = copy.deepcopy(model)
    manager = ScheduledModifierManager.from_yaml(LR_RECIPE.format(lr=args.qat_lr, final_lr=args.qat_lr / 10))
    train(more, train_data, args.qat_steps, args.qat_lr, args.batch, seed=10 * seed + 1, manager=manager)
    more.eval()
    baseline = f"fp32, {args.steps} + {args.qat_steps} steps"
    rows[baseline] = {"path": folder / "fp32_more.onnx", "seconds": None}
    export_onnx(Logits(more), sample, rows[baseline]["path"], input_names=["ids"], output_names=["logits"],
                dynamic_sequence=True)
    drop_exporter_record(rows[baseline]["path"])
    first = 32 * seed % max(1, len(windows) - 32)  # each seed calibrates onnxruntime on 32 windows of its own
    calibration = [{"ids": windows[i:i + 1, :SEQ].astype(np.int64)} for i in range(first, first + 32)]
    # per channel: onnxruntime's blocks as wide as the widest input (a power of two, >= 16); narrower ones are padded
    block = args.group or 1 << (max(args.hidden, args.ffn) - 1).bit_length()
    two_bit = linear_nodes(rows[baseline]["path"], more, args.ternary) if args.ternary else set()
    for label, (path, info) in ort_int4(rows[baseline]["path"], folder, block, calibration, two_bit).items():
        rows[label] = {"path": path, "seconds": info if path else None, "note": "" if path else info}
    grid = "int2/int4" if args.ternary else "int4"
    rows[f"recal {grid}, no QAT"] = dict(zip(("path", "seconds"), recal_int4(
        more, train_data, 0, "minmax", args, folder, sample, "recal_rtn", seed=seed)))
    for observer, distill in (("minmax", False), ("mse", False), ("lsq", False), ("lsq", True)):
        label = f"recal {grid} QAT ({observer}{', distilled' if distill else ''})"
        print(f"  {label}: {args.qat_steps} steps", flush=True)
        rows[label] = dict(zip(("path", "seconds"), recal_int4(
            model, train_data, args.qat_steps, observer, args, folder, sample,
            f"recal_qat_{observer}{'_kd' if distill else ''}", teacher=more if distill else None, seed=seed)))
    # the last QAT model again, with onnxruntime quantizing each layer's input to int8 per block (not exact; the
    # fast 2-bit kernel)
    fast = folder / "recal_qat_lsq_kd_level4.onnx"
    quantize_qat_export(str(folder / "recal_qat_lsq_kd.qat.onnx"), fast, inputs={"ids": sample.numpy()},
                        accuracy_level=4)
    rows[f"recal {grid} QAT (lsq, distilled), accuracy_level 4"] = {"path": fast, "seconds": None}
    ready = {k: r["path"] for k, r in rows.items() if r["path"] is not None}
    for label, path in ready.items():
        rows[label]["ppl"] = perplexity(path, windows)
        rows[label]["bytes"] = path.stat().st_size
    prompt = {"ids": windows[:1, :SEQ].astype(np.int64)}
    token = {"ids": windows[:1, :1].astype(np.int64)}
    ms_prompt = interleaved_latency(ready, prompt, args.rounds, per_round=1, threads=1)
    ms_token = interleaved_latency(ready, token, args.rounds, per_round=3, threads=1, min_seconds=0.05)
    base, rtn = rows[baseline], rows["ort RTN asymmetric (default)"]
    print(f"\n{cpu.describe()}; onnxruntime {ort.__version__}; int4 block/group {args.group}; perplexity on "
          f"{len(windows)} x {SEQ} test tokens; latency 1 thread, median of {args.rounds} interleaved rounds")
    print(f"{'model':30s} {'ppl':>8s} {'recovered':>9s} {'MB':>7s} {'x fp32':>7s} {'prompt ms':>9s} {'token ms':>8s}")
    table = []
    for label, row in rows.items():
        if row["path"] is None:
            print(f"{label:30s} did not run here: {row['note']}")
            table.append({"label": label, "note": row["note"]})
            continue
        lost = rtn.get("ppl", float("nan")) - base["ppl"]
        recovered = (rtn["ppl"] - row["ppl"]) / lost if lost > 0 and not label.startswith("fp32") else float("nan")
        print(f"{label:30s} {row['ppl']:8.4f} {recovered:9.2f} {row['bytes'] / 1e6:7.2f} "
              f"{row['bytes'] / base['bytes']:7.3f} {ms_prompt[label]:9.2f} {ms_token[label]:8.3f}", flush=True)
        table.append({"label": label, "ppl": row["ppl"], "recovered": None if recovered != recovered else recovered,
                      "bytes": row["bytes"], "ms_prompt": ms_prompt[label], "ms_token": ms_token[label]})
    print(f"\nmodels in {folder}")
    return ({"rounds": args.rounds, "group": args.group, "ternary": args.ternary, "steps": args.steps,
             "qat_steps": args.qat_steps, "params": params, "layers": args.layers, "hidden": args.hidden,
             "ffn": args.ffn, "test_tokens": int(windows[:, 1:].size), "train_bytes": len(train_data),
             "files": files, "fp32_bytes": base["bytes"], "baseline": baseline}, table)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "2")
    main()
