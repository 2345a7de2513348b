"""A decoder past protobuf's 2 GB through the whole path on this machine: recipe QAT steps (int4 weight-only),
ONNX export, ``quantize_qat_export``; the time and peak memory of each stage, against the fp32 weights' size.

A Llama-shaped model from a real config (random weights, seeded; nothing downloaded), about 0.6 B parameters by
default (2.5 GB of fp32 weights). Each stage runs in a process of its own, so its peak resident memory
(``ru_maxrss``) is its own: 1. build, train ``--steps`` steps under the recipe (W4A16, groups of 128, the embedding
table int4 too) on the standard library's source as text, finalize, save the model; 2. export to ONNX (external
data past 1.8 GB); 3. convert with verification. The goal (issue 49): export and convert each within 2.5x the fp32
weights' size.

    python scripts/bench_large_decoder.py [--hidden 1536 --layers 20 --vocab 32000] [--json docs/results/large_decoder.json]
"""

from __future__ import annotations

import argparse
import json
import os
import gc
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.results import machine, save
from bench.suite import suite_module

RECIPE = """
- !QuantizationModifier
  start_epoch: 0
  scheme: {input_activations: null, weights: {num_bits: 4, group_size: 128}}
  scheme_overrides: {Embedding: {input_activations: null, weights: {num_bits: 4, group_size: 128}}}
"""


def _config(args):
    import transformers

    return transformers.LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.ffn,
                                    num_hidden_layers=args.layers, num_attention_heads=args.hidden // 64,
                                    num_key_value_heads=max(1, args.hidden // 256), max_position_embeddings=256,
                                    tie_word_embeddings=False)


def _tokens(count: int, vocab: int, seed: int):
    """Token ids from the standard library's own source (bytes folded into the vocabulary): real text."""
    import sysconfig

    import torch

    text = b"".join(p.read_bytes() for p in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:40])
    data = torch.frombuffer(bytearray(text), dtype=torch.uint8).long()
    g = torch.Generator().manual_seed(seed)
    start = int(torch.randint(0, len(data) - count, (1,), generator=g))
    return (data[start:start + count] * 131 + 7) % vocab


def stage_train(args, folder: Path) -> dict:
    import torch
    import transformers

    from recal_torch import ScheduledModifierManager

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(_config(args))
    params = sum(p.numel() for p in model.parameters())
    manager = ScheduledModifierManager.from_yaml(RECIPE)
    optimizer = manager.modify(model, torch.optim.SGD(model.parameters(), lr=1e-3), steps_per_epoch=args.steps)
    model.train()
    seconds = []
    for step in range(args.steps):
        ids = _tokens(args.batch * args.seq, args.vocab, step).reshape(args.batch, args.seq)
        t0 = time.perf_counter()
        optimizer.zero_grad()
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        optimizer.step()
        seconds.append(time.perf_counter() - t0)
        print(f"  step {step}: loss {loss.item():.3f}, {seconds[-1]:.1f}s", flush=True)
    manager.finalize(model)
    torch.save(model.state_dict(), folder / "qat.pt")
    return {"params": params, "fp32_bytes": 4 * params, "step_s": seconds}


def stage_export(args, folder: Path) -> dict:
    import torch
    import transformers

    from recal_torch import ScheduledModifierManager, export_onnx

    CausalLMLogits = suite_module("tests.support.torch_models").CausalLMLogits

    model = transformers.LlamaForCausalLM(_config(args))
    manager = ScheduledModifierManager.from_yaml(RECIPE)
    manager.modify(model, torch.optim.SGD(model.parameters(), lr=1e-3), steps_per_epoch=1)
    model(input_ids=_tokens(args.seq, args.vocab, 0)[None], use_cache=False)  # QAT's plan, on the first forward
    model.load_state_dict(torch.load(folder / "qat.pt", weights_only=True))
    manager.finalize(model)
    (folder / "qat.pt").unlink()
    del manager
    gc.collect()
    _reset_peak()  # what follows is the export, with the trained model in memory as after training
    sample = _tokens(2 * args.seq, args.vocab, 99).reshape(2, args.seq)
    path = export_onnx(CausalLMLogits(model).eval(), sample, folder / "qat.onnx", input_names=["ids"],
                       dynamic_sequence=True)
    torch.save(sample, folder / "sample.pt")
    files = sum(p.stat().st_size for p in folder.iterdir() if p.name.startswith("qat.onnx"))
    return {"onnx_bytes": files, "external_data": any(p.name != "qat.onnx" and p.name.startswith("qat.onnx")
                                                      for p in folder.iterdir()), "path": str(path)}


def stage_convert(args, folder: Path) -> dict:
    import torch

    from recal_onnx import quantize_qat_export

    sample = torch.load(folder / "sample.pt", weights_only=True)
    result = quantize_qat_export(str(folder / "qat.onnx"), folder / "int4.onnx", inputs={"ids": sample.numpy()})
    files = sum(p.stat().st_size for p in folder.iterdir() if p.name.startswith("int4.onnx"))
    return {"int4_bytes": files, "verification": str(result.verification), "weights_note": result.weights_note}


STAGES = {"train": stage_train, "export": stage_export, "convert": stage_convert}


def _reset_peak() -> None:
    """Start this process's peak resident memory (VmHWM) again from now (Linux: ``/proc/self/clear_refs``)."""
    Path("/proc/self/clear_refs").write_text("5")


def _peak() -> int:
    """This process's peak resident memory, in bytes, since it started or :func:`_reset_peak`."""
    line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith("VmHWM:"))
    return int(line.split()[1]) * 1024


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=1536)
    parser.add_argument("--ffn", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=20)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--folder", type=Path, help="keep the files here (default: a temporary folder)")
    parser.add_argument("--json", type=Path, help="also write the results here (docs/results/large_decoder.json)")
    parser.add_argument("--stage", choices=list(STAGES), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.stage:
        import onnx  # noqa: F401  (the libraries every stage imports: memory above them is the stage's own)
        import torch
        import transformers

        import recal_onnx  # noqa: F401
        import recal_torch  # noqa: F401

        base = int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        t0 = time.perf_counter()
        out = STAGES[args.stage](args, args.folder)
        peak = _peak()
        out.update(seconds=time.perf_counter() - t0, peak_bytes=peak, above_imports=peak - base)
        print("RESULT " + json.dumps(out), flush=True)
        return 0
    folder = args.folder or Path(tempfile.mkdtemp(prefix="recal-large-decoder-"))
    folder.mkdir(parents=True, exist_ok=True)
    passed = [f"--{k}={getattr(args, k)}" for k in ("hidden", "ffn", "layers", "vocab", "steps", "batch", "seq")]
    rows = {}
    for stage in STAGES:
        print(f"{stage} ...", flush=True)
        run = subprocess.run([sys.executable, __file__, *passed, "--folder", str(folder), "--stage", stage],
                             stdout=subprocess.PIPE, text=True, env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
        print("\n".join(line for line in run.stdout.splitlines() if not line.startswith("RESULT ")), flush=True)
        if run.returncode:
            raise SystemExit(f"stage {stage} failed (exit {run.returncode})")
        rows[stage] = json.loads(next(line for line in run.stdout.splitlines() if line.startswith("RESULT "))[7:])
    fp32 = rows["train"]["fp32_bytes"]
    print(f"\n{machine()['cpu']}; Llama-shaped, {rows['train']['params'] / 1e9:.2f} B parameters "
          f"({fp32 / 1e9:.2f} GB fp32), hidden {args.hidden}, {args.layers} layers, vocabulary {args.vocab}")
    print("| stage | seconds | peak memory (GB) | above its imports (GB) | x fp32 weights | what it wrote |")
    print("|---|---:|---:|---:|---:|---|")
    wrote = {"train": f"{args.steps} QAT steps ({', '.join(f'{s:.0f}' for s in rows['train']['step_s'])} s)",
             "export": f"{rows['export']['onnx_bytes'] / 1e9:.2f} GB ONNX" + (
                 ", external data" if rows["export"]["external_data"] else ""),
             "convert": f"{rows['convert']['int4_bytes'] / 1e9:.2f} GB int4 ONNX; {rows['convert']['verification']}"}
    for stage, r in rows.items():
        print(f"| {stage} | {r['seconds']:.0f} | {r['peak_bytes'] / 1e9:.2f} | {r['above_imports'] / 1e9:.2f} | "
              f"{r['above_imports'] / fp32:.2f} | {wrote[stage]} |")
    if args.json:
        import torch  # noqa: F401  (so that machine() records its version)
        import transformers

        save(args.json, {**machine(), "transformers": transformers.__version__, "hidden": args.hidden, "layers": args.layers, "vocab": args.vocab,
                         "ffn": args.ffn, "steps": args.steps, "seq": args.seq, "stages": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
