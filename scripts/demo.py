"""`make demo`: the whole promise, in a few minutes on 2 cores.

Accuracy on real data (the bundled digits):
1. a dense baseline in PyTorch (recal:dense);
2. one recipe (recal:prune_quant: GradualKS to 85% on every conv/dense kernel, then
   QAT, with an LR schedule) in PyTorch -> QAT ONNX -> int8 ONNX (quantize_qat_export);
3. the same recipe, QAT included, in the TensorFlow graph API -> QAT ONNX -> int8 ONNX.
Speed on a realistic architecture (synthetic inputs; the digits net is too small for int8 kernels to pay):
4. a ResNet-18-shaped model at 224x224, QAT a few steps, converted: fp32 vs recal int8 vs onnxruntime's
   quantize_static (as it comes and with reduce_range) vs recal with half the filters pruned and thinned, batch 1,
   one thread, with each model's fidelity (scripts/speed.py).
Then the two tables, what this run measured on this CPU, and the paths of everything written; every figure is
also written to ``<output>/demo.json`` (the README's tables are generated from a copy in docs/results/).

    python scripts/demo.py [--output demo_out] [--seed 0] [--no-speed]

Its first part is ``recal demo`` (:mod:`recal_app.demo`), which runs the same from an installed package.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
import warnings
from pathlib import Path

# The demo prints recal's tables: third-party chatter (TensorFlow's C++ logs, torch's exporter noting the absent
# torchvision, libraries' deprecation notices about their own internals) is kept out of them.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
warnings.filterwarnings("ignore", category=FutureWarning)
warnings.filterwarnings("ignore", category=DeprecationWarning)
logging.getLogger("torch.onnx._internal.exporter._registration").setLevel(logging.ERROR)


from recal_app import JOBS, print_jobs, run_jobs  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", default="demo_out")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("--no-speed", action="store_true", help="skip the ResNet-18 speed part")
    parser.add_argument("--speed-size", type=int, default=224, help="the speed part's input size (default 224)")
    parser.add_argument("--rounds", type=int, default=15, help="the speed part's interleaved rounds (default 15)")
    args = parser.parse_args(argv)
    out = Path(args.output)
    started = time.perf_counter()
    rows = run_jobs(out, seed=args.seed, progress=not args.no_progress)  # what `recal demo` runs
    speed_rows = []
    if not args.no_speed:
        import speed

        size = args.speed_size
        print(f"\n== speed: ResNet-18-shaped at {size}x{size} -> {out / 'speed'}", flush=True)
        speed_rows = speed.speed_table(out / "speed", size, args.rounds)
    print(f"\nrecal demo, {time.perf_counter() - started:.0f}s in all")
    print_jobs(rows)
    if speed_rows:
        print(f"\n2. speed on synthetic inputs: ResNet-18-shaped, {args.speed_size}x{args.speed_size}, onnxruntime, batch 1, 1 thread, "
              "interleaved medians; fidelity on 64 inputs in a default session\n")
        print(speed.format_table(speed_rows))
        print("\n" + speed.measured_line(speed_rows))
    from recal_core import write_text_atomically
    from recal_onnx import cpu

    results = {"seconds": round(time.perf_counter() - started), "seed": args.seed, "cpu": cpu.describe(),
               "date": time.strftime("%Y-%m-%d", time.gmtime()), "jobs": [{k: v for k, v in r.items() if k != "path"} for r in rows]}
    if speed_rows:
        results["speed"] = json.loads((out / "speed" / "speed.json").read_text())
        results["speed"]["measured"] = speed.measured_line(speed_rows)
    write_text_atomically(out / "demo.json", json.dumps(results, indent=1) + "\n")
    print("\noutputs:")
    for job in JOBS:
        print(f"  {out / job.folder}/report.md  {out / job.folder}/schedule.png  {out / job.folder}/tensorboard/")
    for r in rows:
        print(f"  {r['path']}")
    for row in speed_rows:
        print(f"  {row.path}")
    print(f"  {out / 'demo.json'}: every figure above")
    print(f"view the training curves: tensorboard --logdir {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
