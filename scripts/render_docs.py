"""Write the measured tables of README.md and docs/ from the JSON the benchmarks and the demo saved, and docs/index.md
from README.md: no figure in the docs is copied by hand.

A generated table sits between two markers, ``<!-- table: NAME -->`` and ``<!-- /table -->``; NAME is one of
:data:`TABLES`, each a function of the files in ``docs/results/`` (written by ``make demo``, copied there, and by
``scripts/bench_*.py --json``). ``--check`` changes nothing and exits 1 when a committed table or docs/index.md
differs from what the JSON gives (CI runs it through ``tests/e2e/test_docs.py``).

    python scripts/render_docs.py [--check]
"""

from __future__ import annotations

import argparse
import math
import re
import statistics
import sys
from pathlib import Path

from bench.results import load, sessions_clause
from code_layout import layout_table

ROOT = Path(__file__).resolve().parent.parent


MARKER = re.compile(r"(<!-- table: (?P<name>[\w-]+) -->\n)(?P<body>.*?)(<!-- /table -->)", re.DOTALL)


def _pct(x: float | None) -> str:
    return "unknown" if x is None else f"{100 * x:.1f}%"


def demo_accuracy() -> str:
    """`make demo`'s first table: the digits, dense vs one recipe in PyTorch and the TensorFlow graph API."""
    demo = load("demo.json")
    lines = ["| framework | run | artefact | test accuracy | sparsity | size |", "|---|---|---|---|---|---|"]
    for job in demo["jobs"]:
        lines.append(f"| {job['framework']} | {job['run']} | {job['artefact']} | {100 * job['accuracy']:.2f}% | "
                     f"{_pct(job['sparsity'])} | {job['size_bytes'] / 1e3:.1f} kB |")
    when = f"{demo['date']}; {demo['cpu']}" if "cpu" in demo else "this project's 2-core machine"
    return "\n".join(lines) + (f"\n\nsizes in kB (10^3 bytes); one run, seed {demo['seed']} (accuracy moves with the seed and "
                                f"the CPU); `make demo` ran {demo['seconds']} s, {when}")


def demo_speed() -> str:
    """`make demo`'s second table: ResNet-18 at 224x224 in onnxruntime, with fidelity beside speed."""
    speed = load("demo.json")["speed"]
    rows = speed["rows"]
    fp32 = rows[0]
    lines = ["| model | size | latency | x fp32 | argmax agreement | max difference | measured against (as written) |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        against = r["reference"]
        if not math.isnan(r["own_agreement"]):  # a peer's file: against itself as written too
            against += f"; its own file: {r['own_agreement']:.3f}"
        if r["steps"] is not None:
            against += f"; {r['steps']:.0f} output step(s)"
        lines.append(f"| {r['label']} | {r['size_mb']:.2f} MB | {r['latency_ms']:.1f} ms | "
                     f"{fp32['latency_ms'] / r['latency_ms']:.2f}x | {r['agreement']:.3f} | "
                     f"{100 * r['max_diff']:.2f}% | {against} |")
    return ("\n".join(lines) + f"\n\nbatch 1, 1 thread, median of {3 * speed['rounds']} interleaved runs, onnxruntime "
            f"{speed['onnxruntime']}, {speed['checks']} synthetic inputs for fidelity; sizes in MB (10^6 bytes). "
            f"{speed['measured']}.")


def reduce_range() -> str:
    """What 7-bit weights cost on the digits, per front end (scripts/bench_reduce_range.py)."""
    data = load("reduce_range.json")
    lines = ["| front end | 8-bit weights | 7-bit weights (`reduce_range: true`) | difference |", "|---|---|---|---|"]
    for framework in dict.fromkeys(r["framework"] for r in data["rows"]):
        mean = {flag: statistics.mean(r["int8_accuracy"] for r in data["rows"]
                                      if r["framework"] == framework and r["reduce_range"] is flag)
                for flag in (False, True)}
        lines.append(f"| {framework} | {100 * mean[False]:.2f}% | {100 * mean[True]:.2f}% | "
                     f"{100 * (mean[True] - mean[False]):+.2f} points |")
    return ("\n".join(lines) + f"\n\nint8 ONNX accuracy on the 360 test digits, `{data['recipe']}`, mean of seeds "
            f"{', '.join(map(str, data['seeds']))} (`scripts/bench_reduce_range.py`)")


def _ratio(row: dict, other: str) -> str:
    """recal's speed-up over ``other``: with repeats, their median and (least-most)."""
    if "ratios" in row:
        values = sorted(row["ratios"][other])
        return f"{statistics.median(values):.2f}x ({values[0]:.2f}-{values[-1]:.2f})"
    return f"{row['latency'][other] / row['latency']['recal']:.2f}x"


def zoo(name: str = "zoo.json") -> str:
    """The CNN zoo at 224x224 against fp32 and onnxruntime's quantize_static, with fidelity (scripts/bench_zoo.py)."""
    data = load(name)
    lines = ["| model | fp32 ms | recal ms | x fp32 | x static | x static rr | recal 8-bit: int8 / uint8 ms | "
             "QAT export in a default session | recal int8 | ort static | ort static rr | float ops left |",
             "|---" * 12 + "|"]
    for row in data["rows"]:
        ms, agree = row["latency"], row["agree"]
        cell = lambda label: f"{agree[label][0]:.3f}, {100 * agree[label][1]:.1f}%"  # noqa: E731
        left = ", ".join(f"{op} x{n}" for op, n in row["float_ops"].items()) or "none"
        lines.append(f"| {row['model']} | {ms['fp32']:.2f} | {ms['recal']:.2f} | {ms['fp32'] / ms['recal']:.2f}x | "
                     f"{_ratio(row, 'ort quantize_static')} | {_ratio(row, 'ort quantize_static reduce_range')} | "
                     f"{ms['recal 8-bit int8']:.2f} / {ms['recal 8-bit uint8']:.2f} | {cell('qat export')} | "
                     f"{cell('recal')} | {cell('ort quantize_static')} | {cell('ort quantize_static reduce_range')} | "
                     f"{left} |")
    sessions = ", every model in turn, each round in fresh sessions" if data.get("timing") == "in turns" else ""
    repeats = data.get("repeats", 1)
    spread = (f"; the whole timing repeated {repeats} times: latency is the median of the repeats, x static the "
              "median speed-up with its least and most in brackets" if repeats > 1 else "; one timing run")
    return ("\n".join(lines) + f"\n\n{data['cpu']}; {data['size']}x{data['size']}, batch 1, 1 thread, median of "
            f"{data['rounds']} interleaved rounds{sessions}{spread} (`python scripts/bench_zoo.py --size "
            f"{data['size']} --rounds {data['rounds']} --repeats {repeats} --json docs/results/{name}`). recal: 7-bit QAT, target any; x static: its speed-up "
            "over `quantize_static` as it comes, x static rr: with `reduce_range`; recal 8-bit: the same net with "
            "8-bit weights, the two files target any writes (int8 weights, for VNNI / AMX and Arm; their uint8 twin, "
            "for x86 without VNNI). Fidelity cells: argmax agreement and largest difference (share of the range) on "
            "64 inputs in a default session, against the model each was made from run as written (recal: its QAT "
            "export; onnxruntime: fp32).")


_TRANSFORMER_TITLES = {"bert": "BERT-base-shaped, sequence {seq}", "vit": "ViT-B/16-shaped, 224x224",
                       "swin": "Swin-tiny, 224x224", "mobilevit": "MobileViT-small, 256x256"}


def _latency_rows(model: dict, base_ms: float) -> list[str]:
    """One transformer's rows: size against fp32, latency at 1 and 2 threads, speed against ``base_ms``,
    argmax agreement (the transformers benchmarks' shared columns)."""
    title = _TRANSFORMER_TITLES[model["model"]].format(seq=model["seq"])
    return [f"| {title} | {row['label']} | {row['bytes'] / 1e6:.1f} ({row['bytes'] / model['fp32_bytes']:.3f}) | "
            f"{row['ms_1']:.1f} | {row['ms_2']:.1f} | {base_ms / row['ms_1']:.2f}x | {row['agree']:.3f} |"
            for row in model["rows"]]


def transformers() -> str:
    """BERT-base- and ViT-B/16-shaped models: fp32, recal int8, onnxruntime's quantizers (scripts/bench_transformers.py)."""
    parts = []
    for data in load("transformers.json")["runs"]:  # one table per CPU
        lines = ["| model | variant | MB (x fp32) | 1 thread ms | 2 threads ms | x fp32 (1 thread) | argmax agreement |",
                 "|---" * 7 + "|"]
        for model in data["models"]:
            lines += _latency_rows(model, next(row["ms_1"] for row in model["rows"] if row["label"] == "fp32"))
        names = " ".join(model["model"] for model in data["models"])
        attention = " --attention" if any("+attention" in r["label"] for m in data["models"] for r in m["rows"]) else ""
        parts.append("\n".join(lines) + f"\n\n{data['cpu']}; onnxruntime {data['onnxruntime']}, batch 1, median of "
                     f"{data['rounds']} interleaved rounds{sessions_clause(data)} (`python "
                     f"scripts/bench_transformers.py --rounds {data['rounds']} --models {names}{attention} --json "
                     "docs/results/transformers.json`); MB = 10^6 "
                     f"bytes. Agreement: argmax on {data['models'][0]['checks']} inputs against the model each was "
                     "made from (recal: its QAT export; onnxruntime: fp32).")
    return "\n\n".join(parts)


NO_RECORD = ("; MB without the torch exporter's per-node record, which recal's converter drops (taken out of the fp32 "
             "file before onnxruntime quantizes it)")


UNDEFINED = (" (on a seed where RTN's model is no worse than the baseline there is nothing to win back: its figure "
             "is left out, and the row says over how many seeds)")


def _per_seed(value) -> list:
    """A figure of one seed or a list of one a seed, as a list (older JSON holds one run)."""
    return value if isinstance(value, list) else [value]


def _shares(values: list) -> str:
    """Shares (fractions, None where a seed had none) as ``median%`` with ``(least%-most%)`` where several."""
    pct = [round(100 * v) or 0 for v in values if v is not None]  # `or 0`: no "-0%"
    if not pct:
        return ""
    some = f"{len(pct)} of {len(values)} seeds" if len(pct) < len(values) else ""  # the others: none to win back
    spread = f"{min(pct)}%-{max(pct)}%" if len(pct) > 1 else ""
    return f"{round(statistics.median(pct))}%" + (f" ({'; '.join(filter(None, (spread, some)))})" if spread or some
                                                   else "")


def _spread(values: list[float], fmt: str) -> str:
    """``median`` of one seed's or several seeds' figures, with ``(least-most)`` where several."""
    text = format(statistics.median(values), fmt)
    return text if len(values) == 1 else f"{text} ({format(min(values), fmt)}-{format(max(values), fmt)})"


def llm_rankings(data: dict) -> str:
    """Which of the table's QAT rows beat which other rows on how many seeds: a ranking the docs state is this
    sentence, generated from the same JSON, so it says where it holds and where it does not."""
    ppl = {row["label"]: _per_seed(row["ppl"]) for row in data["rows"] if "ppl" in row}
    grid = "int2/int4" if data["ternary"] else "int4"
    pairs = [(f"recal {grid} QAT (lsq)", f"recal {grid} QAT (mse)"),
             (f"recal {grid} QAT (mse)", f"recal {grid} QAT (minmax)"),
             (f"recal {grid} QAT (lsq, distilled)", f"recal {grid} QAT (lsq)"),
             (f"recal {grid} QAT (lsq, distilled)", "ort HQQ"), (f"recal {grid} QAT (lsq)", "ort HQQ"),
             (f"recal {grid} QAT (mse)", "ort HQQ"),
             (f"recal {grid} QAT (minmax)", "ort RTN asymmetric (default)")]
    said = []
    for a, b in pairs:
        if a in ppl and b in ppl:
            wins = sum(x < y for x, y in zip(ppl[a], ppl[b]))
            said.append(f"{a.replace(f'recal {grid} ', 'recal ')} below {b.replace(f'recal {grid} ', 'recal ')} on "
                        f"{wins} of {len(ppl[a])}")
    seeds = data.get("seeds", [data.get("seed", 0)])
    every = sum(1 for a, b in pairs if a in ppl and b in ppl and all(x < y for x, y in zip(ppl[a], ppl[b])))
    tally = (f" {every} of these {len(said)} hold on every seed." if len(seeds) > 1 else
             " One seed: these say nothing of another.")
    return f"Lower perplexity, seed by seed (seeds {', '.join(map(str, seeds))}): " + "; ".join(said) + "." + tally


def llm(name: str = "llm.json") -> str:
    """A small decoder on the standard library's source: fp32, onnxruntime's int4 quantizers, recal's int4 QAT
    (scripts/bench_llm.py); with ``ternary`` layers, those at 2 bits. Over several seeds: each figure's median
    and range, and the rankings counted seed by seed."""
    data = load(name)
    several = len(data.get("seeds", [0])) > 1
    lines = [f"| model | test perplexity{', median (least-most)' if several else ''} | recovered | MB (x fp32) | "
             "prompt of 128 ms | one token ms |", "|---" * 6 + "|"]
    for row in data["rows"]:
        if "ppl" not in row:
            lines.append(f"| {row['label']} | did not run here: {row['note']} | | | | |")
            continue
        recovered = _shares(_per_seed(row["recovered"]))
        size = statistics.median(_per_seed(row["bytes"]))
        lines.append(f"| {row['label']} | {_spread(_per_seed(row['ppl']), '.4f')} | {recovered} | {size / 1e6:.2f} "
                     f"({size / data['fp32_bytes']:.3f}) | {statistics.median(_per_seed(row['ms_prompt'])):.2f} | "
                     f"{statistics.median(_per_seed(row['ms_token'])):.3f} |")
    ternary = data["ternary"]
    bits = (f"the layers matching `{ternary}` in 2 bits (recal: ternary, `num_bits: 2`; onnxruntime: its 2-bit "
            f"quantizers), the others int4; blocks (groups) of {data['group']}" if ternary
            else f"int4 in blocks (groups) of {data['group']}")
    grid = "the int2 / int4 grid" if ternary else "the int4 grid"
    return ("\n".join(lines) + f"\n\n{data['cpu']}; onnxruntime {data['onnxruntime']}. A Llama-shaped decoder "
            f"({data['params'] / 1e6:.2f} M parameters, {data['layers']} layers, hidden {data['hidden']}, bytes as "
            f"tokens) trained {data['steps']} steps on {data['train_bytes'] / 1e6:.1f} MB of the standard library's "
            f"source ({data['files']} files, split by file); perplexity on {data['test_tokens']:,} test tokens; "
            f"{bits}; QAT {data['qat_steps']} steps{NO_RECORD}. Latency: 1 thread, batch 1, "
            f"median of {data['rounds']} interleaved rounds{' (the median over seeds)' if several else ''}. Every "
            f"quantized row has the training of the baseline ({data['baseline']}): onnxruntime's quantizers and "
            f"recal's no-QAT row quantize it; recal's QAT trains "
            f"the last {data['qat_steps']} steps on {grid}. Recovered: the share of the perplexity onnxruntime's "
            f"default RTN loses against the baseline that the row wins back{UNDEFINED if several else ''}. "
            f"`{data['command']}`; MB = 10^6 bytes.\n\n"
            + llm_rankings(data))


def llm_variants(names: tuple[str, ...] = ("llm_ternary.json", "llm_ternary_h128.json", "llm_ternary_h96.json")) -> str:
    """The 2-bit rows' recovered share on each setting run with seeds (scripts/bench_llm.py --seeds): whether a
    ranking holds off the table's own setting too."""
    runs = [load(name) for name in names]
    heads = [f"hidden {d['hidden']}, {d['steps']} + {d['qat_steps']} steps, seeds "
             f"{', '.join(map(str, d.get('seeds', [d.get('seed', 0)])))}" for d in runs]
    lines = ["| row | " + " | ".join(heads) + " |", "|---" * (len(runs) + 1) + "|"]
    labels = [r["label"] for r in runs[0]["rows"] if "ppl" in r and not r["label"].startswith("fp32")]
    for label in labels:
        cells = []
        for data in runs:
            row = next((r for r in data["rows"] if r["label"] == label and "ppl" in r), None)
            cells.append(_shares(_per_seed(row["recovered"])) if row else "")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    lost = [statistics.median([(r - b) / b for r, b in zip(_per_seed(_row(d, "ort RTN asymmetric (default)")["ppl"]),
                                                   _per_seed(_row(d, d["baseline"])["ppl"]))]) for d in runs]
    return ("\n".join(lines) + "\n\nRecovered: the share of the perplexity onnxruntime's default RTN loses that the "
            "row wins back, median (least-most) over the seeds; RTN loses "
            + ", ".join(f"{100 * v:.1f}%" for v in lost) + " of perplexity on these settings (median). " + " ".join(f"`{d['command']}`." for d in runs) + "\n\n"
            + "\n\n".join(f"{head.split(', seeds')[0].capitalize()}. {llm_rankings(d)}" for head, d in zip(heads, runs)))


def _row(data: dict, label: str) -> dict:
    return next(r for r in data["rows"] if r["label"] == label)


def digits_int8() -> str:
    """The digits CNN in int8, observed against learned scales (scripts/bench_accuracy.py --rows QAT)."""
    data = load("digits_int8.json")
    lines = ["| run | recipe | accuracy, mean (%) | min | max |", "|---|---|---:|---:|---:|"]
    for row in data["rows"]:
        accs = [100 * a for a in row["accuracy"]]
        lines.append(f"| {row['label']} | `{row['recipe']}` | {sum(accs) / len(accs):.2f} | {min(accs):.2f} | "
                     f"{max(accs):.2f} |")
    return ("\n".join(lines) + f"\n\n{data['cpu']}. The digits' 360 test images, the int8 ONNX model in onnxruntime; "
            f"seeds {', '.join(map(str, data['seeds']))}; recipes bundled with recal (`recal recipes`), the same but for the "
            "QuantizationModifier's scheme (`python scripts/bench_accuracy.py --rows QAT --json "
            "docs/results/digits_int8.json`).")


def thinning_decoder(arch: str = "llama") -> str:
    """An int4 decoder pruned and thinned against dense int4 (bench_transformer_thinning.py, its decoder part run
    with ``--arch``: its figures under ``decoder``, or ``decoder_<arch>``)."""
    from bench_llm import ARCHS
    from bench_transformer_thinning import decoder_key

    data = load("thinning_transformers.json")[decoder_key(arch)]
    rows = {r["label"]: r for r in data["rows"]}
    rtn, dense = rows["ort RTN int4, dense"], rows["recal int4 QAT, dense"]
    lines = ["| model | test perplexity | ppl x ort RTN | ppl x recal dense int4 | MB | MB x ort RTN | prompt of 128 "
             "ms | one token ms | token speed x ort RTN |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in data["rows"]:
        lines.append(f"| {r['label']} | {r['ppl']:.4f} | {r['ppl'] / rtn['ppl']:.3f} | {r['ppl'] / dense['ppl']:.3f} | "
                     f"{r['bytes'] / 1e6:.2f} | "
                     f"{r['bytes'] / rtn['bytes']:.2f} | {r['ms_prompt']:.2f} | {r['ms_token']:.3f} | "
                     f"{rtn['ms_token'] / r['ms_token']:.2f}x |")
    run = "" if arch == "llama" else f" --arch {arch} --settings {' '.join(repr(s) for s in data['settings'])}"
    return ("\n".join(lines) + f"\n\n{data['cpu']}; onnxruntime {data['onnxruntime']}. A {ARCHS[arch]} decoder "
            f"({data['params'] / 1e6:.2f} M parameters, {data['layers']} layers, hidden {data['hidden']}, bytes as "
            f"tokens) trained {data['steps']} steps on the standard library's source ({data['files']} files); every "
            f"int4 row has {data['qat_steps']} more steps at LR {data['qat_lr']:g}: onnxruntime's RTN "
            "quantizes the fp32 model trained on for them, recal's QAT trains them on the int4 grid (groups of "
            f"{data['group']}), the thinned rows pruning heads and FFN neurons during the first "
            f"{round(100 * data['prune_end'])}% of them and thinning them after (distilled: "
            f"`{data['distill'].lstrip('- ')}` from the fp32 model trained on, the one RTN quantizes){NO_RECORD}. "
            f"Perplexity on {data['test_tokens']:,} held-out tokens; latency 1 thread, batch 1, median of "
            f"{data['rounds']} interleaved rounds (`python scripts/bench_transformer_thinning.py --parts decoder{run} "
            "--json docs/results/thinning_transformers.json`).")


def jax_compile() -> str:
    """The first (compiled) and later epochs of Keras on JAX under recipes (scripts/bench_jax_compile.py)."""
    from bench_jax_compile import table

    return table(load("jax_compile.json"))


def lsq_overhead() -> str:
    """The step time of learned against observed quantization scales (bench_lsq_overhead.py)."""
    from bench_lsq_overhead import table

    return table(load("lsq_overhead.json"))


def gpu_check() -> str:
    """recal on a GPU: step time against plain bf16 training, eager and compiled, and the checks (gpu_check.py)."""
    from gpu_check import table

    return table(load("gpu_check.json"))


def large_decoder() -> str:
    """A 0.6 B decoder through QAT, export and conversion: time and peak memory per stage (bench_large_decoder.py)."""
    data = load("large_decoder.json")
    fp32 = data["stages"]["train"]["fp32_bytes"]
    lines = ["| stage | seconds | peak memory above imports (GB) | x fp32 weights | wrote |", "|---|---:|---:|---:|---|"]
    wrote = {"train": f"{data['steps']} QAT steps of batch 1 x {data['seq']} tokens",
             "export": f"{data['stages']['export']['onnx_bytes'] / 1e9:.2f} GB QDQ ONNX",
             "convert": f"{data['stages']['convert']['int4_bytes'] / 1e9:.2f} GB int4 ONNX, verified: "
                        f"{data['stages']['convert']['verification']}"}
    for stage, row in data["stages"].items():
        lines.append(f"| {stage} | {row['seconds']:.0f} | {row['above_imports'] / 1e9:.2f} | "
                     f"{row['above_imports'] / fp32:.2f} | {wrote[stage]} |")
    params = data["stages"]["train"]["params"]
    versions = "".join(f"; {name} {data[name]}" for name in ("torch", "transformers") if name in data)
    return ("\n".join(lines) + f"\n\n{data['cpu']}; onnxruntime {data['onnxruntime']}{versions}. "
            f"A Llama-shaped decoder from a real config ({params / 1e9:.2f} B parameters, {fp32 / 1e9:.2f} GB of fp32 "
            f"weights: hidden {data['hidden']}, {data['layers']} layers, FFN {data['ffn']}, vocabulary {data['vocab']}; "
            "random weights), W4A16 in groups of 128, the embedding table int4 too; each stage in a process of its "
            "own (`python scripts/bench_large_decoder.py --json docs/results/large_decoder.json`).")


def thinning_transformers() -> str:
    """Transformers with heads and FFN neurons thinned: digits ViT accuracy, BERT-base / ViT-B latency
    (scripts/bench_transformer_thinning.py)."""
    data = load("thinning_transformers.json")
    acc = data["accuracy"]
    lines = ["| digits ViT | seed | dense | dense, trained on | pruned (masked) | thinned | thinned int8 | parameters |",
             "|---" * 8 + "|"]
    for setting, m in acc["mean"].items():
        for r in (r for r in acc["rows"] if r["setting"] == setting):
            lines.append(f"| {setting} | {r['seed']} | {100 * r['dense']:.2f}% | {100 * r['dense_longer']:.2f}% | "
                         f"{100 * r['masked']:.2f}% | {100 * r['thinned_fp32']:.2f}% | {100 * r['int8']:.2f}% | "
                         f"{r['params']:,} -> {r['thinned_params']:,} |")
        lines.append(f"| {setting} | **mean** | {100 * m['dense']:.2f}% | {100 * m['dense_longer']:.2f}% | "
                     f"{100 * m['masked']:.2f}% | {100 * m['thinned_fp32']:.2f}% | **{100 * m['int8']:.2f}%** | |")
    lines += ["", "| model | variant | MB (x fp32) | 1 thread ms | 2 threads ms | x the faster onnxruntime quantizer "
              "(1 thread) | argmax agreement |", "|---" * 7 + "|"]
    for model in data["latency"]:
        lines += _latency_rows(model, min(row["ms_1"] for row in model["rows"] if row["label"].startswith("ort")))
    return ("\n".join(lines) + f"\n\n{data['cpu']}; onnxruntime {data['onnxruntime']}. Digits: a ViT (4 layers, "
            f"hidden 64, 6 heads, FFN 128, patches of 2) trained {acc['epochs']} epochs; then {acc['prune_epochs']} "
            f"epochs pruning heads and FFN neurons, thinned, {acc['qat_epochs']} epochs of QAT "
            "(7-bit weights), int8 in onnxruntime on the 360 test images; \"dense, trained on\" is the dense model "
            f"trained the same {acc['prune_epochs'] + acc['qat_epochs']} epochs more. Latency: random weights, batch "
            f"1, median of {data['rounds']} interleaved rounds; the thinned BERT rows keep the token table in int4 "
            "(groups of 32); agreement: argmax on 16 inputs against the model each was made from (recal: its QAT "
            "export; onnxruntime: fp32). `python scripts/bench_transformer_thinning.py --json "
            "docs/results/thinning_transformers.json`; MB = 10^6 bytes.")


def keras_backends() -> str:
    """recal's per-step cost on each Keras backend (scripts/bench_keras_backends.py)."""
    from bench_keras_backends import table

    return table(load("keras_backends.json"))


def keras_backends_summary() -> str:
    """The README's line per Keras backend: what runs there, and recal's cost between mask updates."""
    support = {"tensorflow": ("yes", "yes", "tf2onnx"), "jax": ("yes, not trainable flags", "yes", "jax2onnx"),
               "torch": ("yes", "yes", "torch.onnx")}
    lines = ["| Keras backend | pruning, LR, decay, flags | QAT | export | recal step vs plain `fit` |",
             "|---|---|---|---|---|"]
    for result in load("keras_backends.json")["backends"]:
        times = result["times"]
        ratio = statistics.median(times["recal GMP, between updates"]) / statistics.median(times["plain fit"])
        recal, qat, export = support[result["backend"]]
        lines.append(f"| {result['backend']} | {recal} | {qat} | {export} | {100 * (ratio - 1):+.1f}% |")
    return "\n".join(lines) + ("\n\nThe step's cost between mask updates, a median of interleaved rounds (2 cores; "
                               "repeated runs here moved by up to 15 points, and a negative figure is such noise or "
                               "another compilation, not a speed-up)")


def keras_applications() -> str:
    """keras.applications under recal's Keras QAT on each backend (scripts/bench_keras_applications.py)."""
    from bench_keras_applications import table

    return table(load("keras_applications.json"))


def interop() -> str:
    """Other tools' QDQ files converted, on each CPU measured (scripts/bench_interop.py)."""
    from bench_interop import table

    return table(load("interop.json"))


def real_models() -> str:
    """RapidOCR's pretrained models through quantize_static, then recal (scripts/bench_real_models.py)."""
    from bench_real_models import table

    data = load("real_models.json")
    return (table(data) + f"\n\n{data['cpu']}; onnxruntime {data['onnxruntime']}. Batch 1, 1 thread, default "
            f"sessions, median of {data['repeats']} repeats of 7 interleaved rounds (recal vs QDQ file: the median "
            f"speed-up, least-most in brackets); task agreement with the fp32 model (top-1 per image or position; the "
            f"detector's map at 0.5, per pixel) on {data['samples']} rendered lines of the Python standard library's "
            f"source, or {data.get('detector_samples', 16)} pages of them; peers' rows quantized by their ONNX "
            "quantizers at their defaults (`python scripts/bench_real_models.py --wheel <rapidocr_onnxruntime>/models "
            "--peer nncf <site> --peer modelopt <site> --json docs/results/real_models.json`).")


def real_model_qat() -> str:
    """QAT on RapidOCR's recognizer, beside quantize_static (scripts/real_models/rapidocr_qat.py)."""
    from real_models.rapidocr_qat import table

    data = load("real_model_qat.json")
    return (table(data) + f"\n\n{data['cpu']}; onnxruntime {data['onnxruntime']}. {data['samples']} held-out "
            f"rendered lines; QAT {data['steps']} steps of {data['batch']} lines (AdamW, LR {data['lr']:g} cosine, "
            f"{data['observer']} observers), distilled from fp32 alone, no labels, one run per seed. Latency: batch 1, "
            "1 thread, default sessions, median of 7 interleaved rounds (`python scripts/real_models/rapidocr_qat.py "
            "--wheel <rapidocr_onnxruntime>/models --seeds 0 1 2 --json docs/results/real_model_qat.json`).")


def plan() -> str:
    """Planned recipes against uniform precision and a random plan, at equal size, at equal summed layer time, and
    within both, each after the same QAT, over seeds (scripts/bench_plan.py)."""
    from bench_plan import table, wins

    data = load("plan.json")
    runs, n = data["runs"], len(data["runs"])
    first = runs[0]
    agree = ", ".join(str(r["plans_agree_on"]) for r in runs)
    measured, fisher = "recal plan (measured)", "recal plan (fisher estimate)"
    fast, pruning = "recal plan at int4's ms (measured)", "recal plan, pruning too (measured)"
    fast_random = "random plan at int4's ms"
    both, both_fisher = "recal plan within size and ms (measured)", "recal plan within size and ms (fisher estimate)"
    ms = ", ".join(f"{r['budget_ms']:.3f}" for r in runs)
    both_ms = ", ".join(f"{r['both_ms']:.3f}" for r in runs)
    return (table(data) + f"\n\n{data['cpu']}; onnxruntime {data['onnxruntime']}. A Llama-shaped decoder over bytes "
            f"({data['layers']} layers, hidden {data['hidden']}; {first['layers_planned']} Linear layers planned), "
            f"{data['steps']} fp32 steps on the standard library's source, then {data['qat_steps']} QAT steps under "
            f"each plan. Equal size: within {first['budget_bytes'] / 1e3:.1f} kB of weights and scales, "
            f"{data['between']:.0%} of the way from uniform int2's size to int4's. Equal time: within uniform int4's "
            f"summed layer time ({ms} ms by seed), each layer's candidates timed alone in onnxruntime "
            "(`recal_onnx.timed_candidates`, one token, one thread). Size and time: within that size and a time "
            f"halfway between the size plan's and the fastest plan's of that size ({both_ms} ms), which no uniform "
            f"precision meets. Over seeds {', '.join(map(str, data['seeds']))} (each: the fp32 model's weights and "
            "data order, the calibration batches, the random plans), perplexity below, seed by seed: at equal size, "
            f"the measured plan's below uniform int2's in {wins(data, measured, 'uniform int2 (smaller)')} of {n}, "
            f"below the random plan's in {wins(data, measured, 'random plan')} of {n}, below the Fisher estimate's "
            f"plan's in {wins(data, measured, fisher)} of {n}; the Fisher plan's below the random plan's in "
            f"{wins(data, fisher, 'random plan')} of {n}; the two recal plans agree on {agree} of "
            f"{first['layers_planned']} layers. Within size and time, the measured plan's below the random plan's "
            f"in {wins(data, both, 'random plan within size and ms')} of {n}, the Fisher plan's in "
            f"{wins(data, both_fisher, 'random plan within size and ms')} of {n}. At equal time, the measured plan's "
            f"below uniform int4's in {wins(data, fast, 'uniform int4 (larger)')} of {n} and below the random "
            f"plan's in {wins(data, fast, fast_random)} of {n}. With pruning candidates too (each "
            "MLP's hidden channels by 25% or 50%, thinned after QAT), the size plan's below the precision-only "
            f"plan's in {wins(data, pruning, measured)} of {n}. Bits: the first seed's plan. Perplexity (median, "
            "least-most) on 128 held-out windows of 128 bytes; planned ms: the plan's layers' summed time as timed "
            "alone; token ms: the whole converted model's, one token, 1 thread, median of 9 interleaved rounds "
            "(`python scripts/bench_plan.py --seeds 0 1 2 --json docs/results/plan.json`).")


def plan_curve() -> str:
    """The best plan (measured score) at budgets across the range of sizes and of summed times: the Pareto curves a
    budget is chosen on, the first seed's (scripts/bench_plan.py)."""
    data = load("plan.json")
    run = data["runs"][0]
    lines = ["| budget over | planned kB | planned ms | summed score | weights at 8 / 4 / 2 bits / float |",
             "|---|---|---|---|---|"]
    for cost, label in (("bytes", "size"), ("latency", "time")):
        for point in run["curves"][cost]:
            counts = " / ".join(str(point["bits"].get(str(b), 0)) for b in (8, 4, 2, 32))
            lines.append(f"| {label} | {point['bytes'] / 1e3:.1f} | {point['ms']:.3f} | {point['score']:.4f} | "
                         f"{counts} |")
    return ("\n".join(lines) + f"\n\nSeed {run['seed']}'s decoder above; each row the least summed score (the measured "
            "loss increase of each layer alone quantized, summed) within a budget, at budgets spread from the "
            "smallest (or fastest) plan to the largest (or slowest); a budget the best plan does not use up gives "
            "the row before it again, and is left out. `recal plan --plot` draws the same curve for your model.")


def plan_cnn(name: str = "plan_cnn.json") -> str:
    """A CNN's planned recipes (each layer int8 or float, filters pruned) against uniform pruning and a random plan,
    each after the same QAT, over seeds (scripts/bench_plan_cnn.py)."""
    from bench_plan_cnn import MODELS, table

    data = load(name)
    model = data.get("model", "resnet")
    runs, n = data["runs"], len(data["runs"])
    first = runs[0]
    rows = [{r["plan"]: i for i, r in enumerate(run["rows"])} for run in runs]

    def wins(plan: int, other: int, key: str = "cross_entropy") -> int:
        """Seeds where row ``plan``'s ``key`` is below row ``other``'s (rows by position: the uniform row's label
        names its level)."""
        return sum(run["rows"][plan][key] < run["rows"][other][key] for run in runs)

    at = rows[0]
    uniform, measured, fisher, rand = 1, at["recal plan (measured)"], at["recal plan (fisher estimate)"], \
        at["random plan"]
    fast, fast_random = at["recal plan at uniform's ms (measured)"], at["random plan at uniform's ms"]
    levels = ", ".join(dict.fromkeys(f"{run['uniform_level']:.0%}" for run in runs))  # by seed, where they differ
    budget = ", ".join(dict.fromkeys(f"{run['budget_bytes'] / 1e3:.1f}" for run in runs))
    return (table(data) + f"\n\n{data['cpu']}; onnxruntime {data['onnxruntime']}. {MODELS[model]}, random "
            f"initial weights; {first['layers_planned']} layers planned: its convolutions and classifier) on "
            f"scikit-learn's digits upscaled to 32x32, {data['steps']} fp32 steps "
            f"(batch 64), planned on {data['calibration']} training batches of 64, then {data['qat_steps']} QAT "
            f"steps under each plan. Equal size: within {data['share']:.0%} of uniform int8's bytes ({budget} kB), "
            f"met uniformly by pruning every channel space by {levels}. Over seeds "
            f"{', '.join(map(str, data['seeds']))}, held-out cross-entropy, seed by seed: the measured plan's below "
            f"uniform pruning's in {wins(measured, uniform)} of {n}, below the random plan's in "
            f"{wins(measured, rand)} of {n}, below the Fisher plan's in {wins(measured, fisher)} of {n}; the Fisher "
            f"plan's below uniform pruning's in {wins(fisher, uniform)} of {n} and below the random plan's in "
            f"{wins(fisher, rand)} of {n}. Accuracy, the measured plan's above uniform pruning's in "
            f"{wins(uniform, measured, 'accuracy')} of {n}. At uniform pruning's summed layer time, the measured "
            f"plan's cross-entropy below uniform pruning's in {wins(fast, uniform)} of {n} and below the random "
            f"plan's in {wins(fast, fast_random)} of {n}; as a whole converted model it took "
            f"{statistics.median(run['rows'][fast]['ms_image'] for run in runs):.3f} ms an image against uniform pruning's "
            f"{statistics.median(run['rows'][uniform]['ms_image'] for run in runs):.3f} (the Quantize and Dequantize between "
            "its int8 and float layers are in no layer's time). int8 layers and spaces pruned: the first seed's plan. "
            "Accuracy and cross-entropy (median, least-most) of the converted model in onnxruntime on the 360 "
            "held-out digits; planned ms: the plan's layers' summed time, each timed alone (one image, one "
            "thread); image ms: the whole converted model's, 1 thread, median of 9 interleaved rounds "
            f"(`python scripts/bench_plan_cnn.py{' --model mobilenet' if model == 'mobilenet' else ''} --seeds 0 1 2 "
            f"--json docs/results/{name}`).")


def layer_latency() -> str:
    """One Linear layer's time at each weight width in onnxruntime (scripts/bench_layer_latency.py)."""
    from bench_layer_latency import table

    data = load("layer_latency.json")
    spans = []
    for level in (0, 4):
        one = [r["ms"] for r in data["rows"] if r["rows"] == 1 and r["accuracy_level"] == level]
        ratios = {b: [ms[b] / ms["32"] for ms in one] for b in ("8", "4", "2")}
        spans.append(f"at accuracy_level {level}, " + ", ".join(
            f"{b} bits {min(r):.2f}-{max(r):.2f}x float's time" for b, r in ratios.items()))
    return (table(data) + "\n\nOne row (a decoder's one-token step): " + "; ".join(spans)
            + f". {data['cpu']}; onnxruntime {data['onnxruntime']}; {data['threads']} thread, groups "
            f"of {data['group']}; each shape's candidates timed together in interleaved rounds, the medians "
            "(`python scripts/bench_layer_latency.py --json docs/results/layer_latency.json`).")


def plan_time() -> str:
    """``recal plan`` itself on a ~100M-parameter decoder, timed (scripts/bench_plan_time.py)."""
    from bench_plan_time import table

    data = load("plan_time.json")
    return (table(data) + f"\n\n{data['cpu']}; {data['threads']} cores. A Llama-shaped decoder over bytes, "
            f"{data['params'] / 1e6:.1f} M parameters ({data['layers']} layers, hidden {data['hidden']}, "
            f"feed-forward {data['ffn']}), {data['samples']} calibration windows of 128 bytes in batches of "
            f"{data['batch_size']}; minutes from the command's start to its end, the model's build included "
            "(`python scripts/bench_plan_time.py --json docs/results/plan_time.json`).")


def export() -> str:
    """export_onnx's time against torch.onnx's export of the float model (scripts/bench_export.py)."""
    from bench_export import table

    return table(load("export.json"))


def learned_scales() -> str:
    """Learned scales at float32's floor after a Trainer run under AdamW (scripts/bench_learned_scales.py)."""
    from bench_learned_scales import table

    data = load("learned_scales.json")
    run = data["runs"][0]
    return (table(data) + f"\n\n{run['cpu']}; {run['threads']} threads; {run['rows'][0]['steps']} steps each; "
            "at the floor: the scales at or below float32's eps at the end, one figure per seed; warned: whether "
            "recal's floor warning was raised during any run (`python scripts/bench_learned_scales.py --lrs 1e-2 "
            "1e-3 --seeds 0 1 2 --json docs/results/learned_scales.json`).")


def avx2_exactness() -> str:
    """The AVX2 suite's models verified on this CPU's kernels and under an emulated Haswell
    (scripts/avx2_exactness.py)."""
    from avx2_exactness import table

    return (table(load("avx2_exactness.json")) + "\n\nEach conversion on 8 generated samples, target any "
            "(`python scripts/avx2_exactness.py --json docs/results/avx2_exactness.json`). The emulated column is the "
            "same onnxruntime wheel dispatching its AVX2 kernels under qemu: exactness, never speed.")


TABLES = {"interop": interop, "demo-accuracy": demo_accuracy, "demo-speed": demo_speed, "reduce-range": reduce_range, "zoo": zoo,
          "zoo-vnni": lambda: zoo("zoo_vnni.json"), "zoo-vnni-amd": lambda: zoo("zoo_vnni_amd.json"),
          "transformers": transformers, "llm": llm, "llm-ternary": lambda: llm("llm_ternary.json"), "llm-variants": llm_variants,
          "plan-curve": plan_curve, "layer-latency": layer_latency, "plan-time": plan_time,
          "digits-int8": digits_int8,
          "thinning-transformers": thinning_transformers, "keras-applications": keras_applications,
          "keras-backends": keras_backends, "keras-backends-summary": keras_backends_summary, "layout": layout_table,
          "large-decoder": large_decoder, "thinning-decoder": thinning_decoder,
          "thinning-decoder-neox": lambda: thinning_decoder("gpt-neox"),
          "jax-compile": jax_compile, "gpu-check": gpu_check,
          "lsq-overhead": lsq_overhead, "avx2-exactness": avx2_exactness, "real-models": real_models,
          "real-model-qat": real_model_qat, "plan": plan, "plan-cnn": plan_cnn,
          "plan-cnn-mobilenet": lambda: plan_cnn("plan_cnn_mobilenet.json"), "export": export,
          "learned-scales": learned_scales}


def render(text: str) -> str:
    """``text`` with every marked table written anew."""
    def table(match: re.Match) -> str:
        name = match.group("name")
        if name not in TABLES:
            raise SystemExit(f"unknown table {name!r}; known: {', '.join(TABLES)}")
        return match.group(1) + TABLES[name]() + "\n" + match.group(4)

    return MARKER.sub(table, text)


def index_page(readme: str) -> str:
    """docs/index.md: the README, its links into docs/ made relative to docs/."""
    page = re.sub(r"\]\(docs/", "](", readme)
    return "<!-- generated from README.md by scripts/render_docs.py: edit README.md -->\n" + page


def outputs() -> dict[Path, str]:
    """Every generated file's path and the text it should hold."""
    out = {}
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        if path.name != "index.md":
            out[path] = render(path.read_text())
    out[ROOT / "docs" / "index.md"] = index_page(out[ROOT / "README.md"])
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if a file would change")
    args = parser.parse_args(argv)
    stale = []
    for path, text in outputs().items():
        if not path.exists() or path.read_text() != text:
            stale.append(path.relative_to(ROOT))
            if not args.check:
                path.write_text(text)
    if args.check and stale:
        print(f"generated from docs/results/ and README.md, but differ: {', '.join(map(str, stale))}; "
              "run python scripts/render_docs.py", file=sys.stderr)
        return 1
    print(f"{'would change' if args.check else 'wrote'} {len(stale)} file(s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
