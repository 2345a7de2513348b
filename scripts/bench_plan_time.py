"""How long ``recal plan`` takes on a ~100M-parameter decoder, on this machine: the command itself, as a user runs it.

A Llama-shaped decoder over bytes (``--layers``, ``--hidden``; about 99 M parameters at the defaults, random
initial weights: the time does not depend on what the weights learned) is built by a ``module:function`` factory
the script writes; the calibration data is ``--samples`` windows of 128 bytes of the standard library's source, as
an ``.npz`` of token ids. ``recal plan`` then runs with the measured score, with the Fisher estimate, and with the
Fisher estimate, pruning candidates (each MLP's hidden channels by 25% or 50%) and a latency budget within the size
(each layer's candidates timed in onnxruntime, one token), each timed from the command's start to its end; ``recal
check`` reads each recipe written.

    python scripts/bench_plan_time.py [--layers 14] [--hidden 768] [--samples 4] [--json docs/results/plan_time.json]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from bench.results import machine, report
from bench_llm import SEQ, corpus

ROOT = Path(__file__).resolve().parent.parent

FACTORY = """\
import torch
import transformers


def build():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=256, hidden_size={hidden}, intermediate_size={ffn},
                                      num_hidden_layers={layers}, num_attention_heads={heads},
                                      num_key_value_heads={heads}, max_position_embeddings={seq},
                                      tie_word_embeddings=False)
    return transformers.LlamaForCausalLM(config).eval()
"""

CLI = "import sys; from recal_app.cli import main; sys.exit(main())"  # the `recal` command, from this interpreter

RUNS = (("measured score, bits=4", ["--budget", "bits=4"]),
        ("fisher estimate, bits=4", ["--score", "fisher", "--budget", "bits=4"]),
        ("fisher estimate, pruning too, latency within bits=4", ["--score", "fisher", "--prune-levels", "0.25,0.5",
                                                                 "--budget", "latency=10s", "--budget", "bits=4",
                                                                 "--rows", "1"]))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=14)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--samples", type=int, default=4, help="calibration windows of 128 bytes")
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    ffn = 8 * args.hidden // 3 // 64 * 64
    train, _, _ = corpus(2_000_000, 0)
    starts = np.random.default_rng(0).integers(0, len(train) - SEQ, args.samples)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        Path(tmp, "plan_model.py").write_text(FACTORY.format(hidden=args.hidden, ffn=ffn, layers=args.layers,
                                                             heads=args.hidden // 64, seq=2 * SEQ))
        np.savez(Path(tmp, "calibration.npz"), inputs=np.stack([train[s:s + SEQ] for s in starts]).astype(np.int64))
        env = {**os.environ, "RECAL_CACHE": tmp, "PYTHONPATH": str(ROOT)}
        sys.path.insert(0, tmp)
        from plan_model import build

        params = sum(p.numel() for p in build().parameters())
        for i, (label, flags) in enumerate(RUNS):
            print(f"recal plan, {label}", flush=True)
            start = time.perf_counter()
            done = subprocess.run([sys.executable, "-c", CLI, "plan", "--model", "plan_model:build", "--data",
                                   "calibration.npz", "--batch-size", str(args.batch_size), "-o", f"plan{i}.yaml",
                                   *flags], cwd=tmp, env=env, stdout=subprocess.PIPE, text=True)
            seconds = time.perf_counter() - start
            if done.returncode:
                raise SystemExit(f"recal plan ({label}) failed: exit {done.returncode}")
            check = subprocess.run([sys.executable, "-c", CLI, "check", f"plan{i}.yaml"], cwd=tmp, env=env,
                                   capture_output=True, text=True)
            said = done.stdout.strip().splitlines()[-1]
            rows.append({"run": label, "seconds": seconds, "checked": check.returncode == 0, "said": said})
            print(f"  {seconds / 60:.1f} min; {said}", flush=True)
    data = {**machine(), "threads": os.cpu_count(), "params": params, "layers": args.layers, "hidden": args.hidden,
            "ffn": ffn, "samples": args.samples, "batch_size": args.batch_size, "rows": rows}
    return report(data, table(data), args.json)


def table(data: dict) -> str:
    lines = ["| recal plan | minutes | recal check | what it said |", "|---|---|---|---|"]
    for row in data["rows"]:
        lines.append(f"| {row['run']} | {row['seconds'] / 60:.1f} | {'valid' if row['checked'] else 'INVALID'} | "
                     f"{row['said']} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
