"""``recal quantize-qat-export IN OUT``: the command-line face of :func:`quantize_qat_export`."""

from __future__ import annotations

import argparse
import math
import warnings

from .convert import UnconvertedOpsWarning, quantize_qat_export


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("quantize-qat-export", help="turn a QAT (QDQ) ONNX model into a fully quantized one",
                            description=quantize_qat_export.__doc__.splitlines()[0])
    add_arguments(parser)
    parser.set_defaults(func=run)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("input", help="QAT ONNX model (QuantizeLinear/DequantizeLinear)")
    parser.add_argument("output", help="where to write the quantized model (not the input)")
    parser.add_argument("--format", choices=("qoperator", "qdq"), default="qoperator",
                        help="qoperator: QLinearConv/QGemm/... (default); qdq: folded, cleaned QDQ")
    parser.add_argument("--no-verify", action="store_true", help="skip the onnxruntime comparison")
    parser.add_argument("--no-thin", action="store_true",
                        help="keep channels filter pruning left dead (by default they are removed)")
    parser.add_argument("--weight-type", choices=("auto", "int8", "uint8"), default="auto",
                        help="int8: fast and exact on CPUs with VNNI / AMX and on Arm; uint8: exact on x86 without "
                             "VNNI; auto (default): int8 unless this CPU is x86 without VNNI")
    parser.add_argument("--tolerance", type=_tolerance, help="largest accepted max-abs difference (a finite number >= 0)")


def _tolerance(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"expected a finite number >= 0, got {text!r}")
    return value


def run(args: argparse.Namespace) -> int:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", UnconvertedOpsWarning)
        result = quantize_qat_export(args.input, args.output, format=args.format, verify=not args.no_verify,
                                     tolerance=args.tolerance, thin=not args.no_thin,
                                     weight_type=args.weight_type)
    for w in caught:
        print(f"warning: {w.message}")
    done = ", ".join(f"{k} {v}" for k, v in result.rewrites.items() if v)
    weights = f"{result.weight_type} weights"
    if args.weight_type == "auto" and result.weight_type == "uint8":
        weights += ": this CPU has no VNNI; --weight-type int8 for one that has"
    print(f"wrote {result.path} ({result.path.stat().st_size / 1e6:.2f} MB, {weights}) in {result.seconds:.2f}s: "
          f"{done}")
    if result.rounded_biases:
        print(f"note: {result.rounded_biases_note}")
    if result.verification is not None:
        print(f"verified in onnxruntime: {result.verification}")
    return 0
