"""What one Linear layer's weight precision costs in time in onnxruntime, on this CPU: the table a latency budget is
planned from (``recal_onnx.timed_candidates``, the timer ``recal plan --budget latency=`` uses).

Each shape (rows x inputs -> outputs: a decoder's projections at hidden 128, 768 and 2048; one row is a one-token
decode step, 128 a prompt) runs as the converted model runs it: ``MatMulNBits`` at 8, 4 and 2 bits (groups of 32)
at ``accuracy_level`` 0 (float arithmetic, exact: recal's default) and 4 (int8 inputs, onnxruntime's fast kernels,
inexact), and the float ``MatMul``; the candidates of a shape timed together in interleaved rounds (median), on one
thread.

    python scripts/bench_layer_latency.py [--threads 1] [--json docs/results/layer_latency.json]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from bench.results import machine, report
from recal_core import precision_plan
from recal_onnx import timed_candidates

SHAPES = ((1, 128, 384), (1, 768, 2048), (1, 2048, 768), (1, 2048, 5632), (128, 768, 2048))
BITS = (32, 8, 4, 2)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    rows = []
    for rows_, k, n in SHAPES:
        for level in (0, 4):
            layer = precision_plan.LayerCandidates("layer", k * n, tuple(precision_plan.Candidate(b, 0.0, 0.0)
                                                                          for b in BITS), k, n, rows_)
            timed = timed_candidates([layer], accuracy_level=level, threads=args.threads, cache=False)[0]
            ms = {c.bits: c.latency for c in timed.candidates}
            rows.append({"rows": rows_, "in": k, "out": n, "accuracy_level": level, "ms": {str(b): ms[b] for b in BITS}})
            print(rows[-1], flush=True)
    data = {**machine(), "threads": args.threads, "group": 32, "rows": rows}
    return report(data, table(data), args.json)


def table(data: dict) -> str:
    """Each shape and accuracy level: float's time, and each width's as a multiple of it."""
    lines = ["| rows x in -> out | accuracy_level | float ms | 8 bits (x float) | 4 bits (x float) | 2 bits (x float) |",
             "|---|---|---|---|---|---|"]
    for row in data["rows"]:
        ms = row["ms"]
        cells = " | ".join(f"{ms[str(b)]:.3f} ({ms[str(b)] / ms['32']:.2f})" for b in BITS[1:])
        lines.append(f"| {row['rows']} x {row['in']} -> {row['out']} | {row['accuracy_level']} | {ms['32']:.3f} | "
                     f"{cells} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
