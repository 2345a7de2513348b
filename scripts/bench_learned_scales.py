"""Whether learned quantization scales (``observer: lsq``) stay off float32's floor under AdamW in the Hugging Face
Trainer: the run issue 70 reported (217 weight groups of a 5 M decoder at the floor after 300 steps at LR 1e-3).

A Llama-shaped decoder over bytes (``bench_llm.py``'s, 6 layers, hidden 256: 5.2 M parameters), int4 weight-only
in groups of 32 with learned scales, trained by ``transformers.Trainer`` with ``RecalTrainerCallback`` on the
Python standard library's source (windows of 128 bytes), AdamW at each ``--lrs`` (cosine, no warm-up). Counted at
the end: the learned scales at or below float32's eps (the floor), out of all of them, and whether recal warned
during the run; and the held-out loss.

    python scripts/bench_learned_scales.py [--steps 300] [--lrs 1e-3 1e-4] [--seeds 0] [--json FILE]
"""

from __future__ import annotations

import argparse
import math
import statistics
import tempfile
import warnings
from pathlib import Path

import numpy as np
import torch

from bench.results import machine, save_run
from bench_llm import SEQ, build, corpus

RECIPE = """
modifiers:
- !EpochRangeModifier {start_epoch: 0, end_epoch: 1}
- !QuantizationModifier
  start_epoch: 0
  scheme:
    input_activations: null
    weights: {num_bits: 4, symmetric: true, strategy: group, group_size: 32, observer: lsq}
"""


class _ByteLM(torch.nn.Module):
    """The decoder as the Trainer wants it: ``forward(input_ids)`` returns the loss."""

    def __init__(self, lm: torch.nn.Module):
        super().__init__()
        self.lm = lm

    def forward(self, input_ids):
        return {"loss": self.lm(input_ids=input_ids, labels=input_ids, use_cache=False).loss}


def _windows(data: np.ndarray, seed: int, count: int) -> np.ndarray:
    """``count`` windows of ``SEQ`` bytes of ``data``, drawn with ``seed``."""
    starts = np.random.default_rng(seed).integers(0, len(data) - SEQ - 1, count)
    return np.stack([data[s:s + SEQ] for s in starts]).astype(np.int64)


def run(lr: float, steps: int, seed: int, data: tuple[np.ndarray, np.ndarray], batch: int = 8) -> dict:
    """One Trainer run on ``data`` (train and held-out bytes, ``bench_llm.corpus``); the floored scales at its
    end."""
    import transformers

    from recal_torch.integrations import RecalTrainerCallback

    torch.manual_seed(seed)
    model = _ByteLM(build(6, 256))
    train = [{"input_ids": torch.from_numpy(w)} for w in _windows(data[0], seed, steps * batch)]
    held = torch.from_numpy(_windows(data[1], seed, 64))
    callback = RecalTrainerCallback(RECIPE)
    with tempfile.TemporaryDirectory() as out, warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        args = transformers.TrainingArguments(out, max_steps=steps, per_device_train_batch_size=batch, learning_rate=lr,
                                              optim="adamw_torch", lr_scheduler_type="cosine", save_strategy="no",
                                              report_to="none", use_cpu=True, disable_tqdm=True, logging_steps=steps,
                                              seed=seed)
        trainer = transformers.Trainer(model=model, args=args, train_dataset=train, callbacks=[callback])
        trainer.train()
    floor = torch.finfo(torch.float32).eps
    scales = [m.scale.detach() for m in model.modules() if getattr(m, "learned", False) and hasattr(m, "scale")]
    total = sum(s.numel() for s in scales)
    floored = sum(int((s <= floor).sum()) for s in scales)
    with torch.no_grad():
        model.eval()
        loss = float(model(held)["loss"])
    warned = [str(w.message) for w in said if "float32's eps" in str(w.message)]
    return {"lr": lr, "seed": seed, "steps": steps, "scales": total, "floored": floored,
            "warned": bool(warned), "held_out_loss": loss, "perplexity": math.exp(loss)}


def table(data: dict) -> str:
    """The floored scales of each run (one per CPU in the saved file)."""
    lines = ["| CPU | AdamW LR | seeds | learned scales | at the floor | warned | held-out perplexity, median |",
             "|---|---:|---:|---:|---:|---|---:|"]
    for cpu_run in data["runs"]:
        cpu = cpu_run["cpu"].split(",")[0].removeprefix("CPU: ")
        for lr in sorted({r["lr"] for r in cpu_run["rows"]}, reverse=True):
            rows = [r for r in cpu_run["rows"] if r["lr"] == lr]
            ppl = [r["perplexity"] for r in rows]
            lines.append(f"| {cpu} | {lr:g} | {len(rows)} | {rows[0]['scales']} | "
                         f"{', '.join(str(r['floored']) for r in rows)} | "
                         f"{'yes' if any(r['warned'] for r in rows) else 'no'} | {statistics.median(ppl):.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--lrs", type=float, nargs="+", default=[1e-3, 1e-4])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path, help="also keep this CPU's run here")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    train, test, _ = corpus(4_000_000, 500_000)  # read once: the same bytes for every run
    rows = []
    for lr in args.lrs:
        for seed in args.seeds:
            rows.append(run(lr, args.steps, seed, (train, test)))
            print(rows[-1], flush=True)
    result = {**machine(), "threads": args.threads, "rows": rows}
    print(table({"runs": [result]}))
    if args.json:
        save_run(args.json, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
