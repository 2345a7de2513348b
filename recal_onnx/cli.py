"""``recal quantize-qat-export IN OUT``: the command-line face of :func:`quantize_qat_export`."""

from __future__ import annotations

import argparse
import math
import warnings

from .convert import quantize_qat_export
from .errors import UnconvertedOpsWarning
from .targets import DEFAULT_TARGET, TARGETS, WEIGHT_TYPES
from .user_inputs import load_inputs, parse_shape


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("quantize-qat-export", help="turn a QAT (QDQ) ONNX model into a fully quantized one",
                            description=quantize_qat_export.__doc__.splitlines()[0])
    add_arguments(parser)
    parser.set_defaults(func=run)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("input", help="QAT ONNX model (QuantizeLinear/DequantizeLinear, or QONNX's Quant)")
    parser.add_argument("output", help="where to write the quantized model (not the input)")
    parser.add_argument("--format", choices=("qoperator", "qdq"), default="qoperator",
                        help="qoperator: QLinearConv/QGemm/... (default); qdq: folded, cleaned QDQ")
    parser.add_argument("--encodings", metavar="FILE",
                        help="AIMET's .encodings file, with the float model QuantizationSimModel.export wrote "
                             "beside it")
    parser.add_argument("--inputs", metavar="FILE.npz",
                        help="verify on your own data: an .npz of arrays by input name (np.savez('in.npz', x=batch)); "
                             "by default inputs are generated (normal floats, token ids over the vocabulary)")
    parser.add_argument("--input-shape", metavar="NAME=D1,D2,...", action="append", default=[], type=_shape,
                        help="the shape of generated inputs for an input whose dimensions the model leaves open "
                             "(the first is the batch), e.g. x=1,3,640,640; repeat for each input. Default: 32 per "
                             "image side, 16 per sequence axis")
    parser.add_argument("--no-verify", action="store_true", help="skip the onnxruntime comparison")
    parser.add_argument("--no-thin", action="store_true",
                        help="keep channels filter pruning left dead (by default they are removed)")
    parser.add_argument("--target", choices=TARGETS, default=DEFAULT_TARGET,
                        help="the CPUs the model is for: any (default: int8 weights for x86 with VNNI or AMX and "
                             "Arm, and beside the output OUTPUT-stem.x86-avx2.onnx, exact on x86 without VNNI), "
                             "x86-avx2, x86-vnni, arm64, native (this CPU's kind); decides how weights beyond +-64 "
                             "are stored (a model trained with reduce_range: true has none: one int8 file for every "
                             "target)")
    parser.add_argument("--weight-type", choices=WEIGHT_TYPES, default="auto",
                        help="override the target's choice: int8 (exact with VNNI / AMX and on Arm), uint8 (weights "
                             "beyond +-64 as uint8: exact everywhere); auto (default): the target's")
    parser.add_argument("--tolerance", type=_tolerance,
                        help="largest accepted max-abs difference (a finite number >= 0); default (none given): 3 "
                             "steps of a "
                             "quantized output, 10%% of a float output's range, or as far as onnxruntime's own session "
                             "of the input, or the QAT model's own rounding noise, where op by op every difference is "
                             "a value on a rounding boundary")
    parser.add_argument("--accuracy-level", type=int, choices=(0, 1, 2, 3, 4), default=0,
                        help="how MatMulNBits (weight-only layers) computes: 0 (default) in float, exactly the QAT "
                             "model; 4 on int8-quantized inputs (onnxruntime's fast kernels, not exact)")
    parser.add_argument("--keep-exporter-metadata", action="store_true",
                        help="keep the torch exporter's per-node module paths and stack traces (dropped by default)")


def _shape(text: str) -> tuple[str, list[int]]:
    try:
        return parse_shape(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _tolerance(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"expected a finite number >= 0, got {text!r}")
    return value


def run(args: argparse.Namespace) -> int:
    inputs = load_inputs(args.inputs) if args.inputs else None
    shapes = dict(args.input_shape) or None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", UnconvertedOpsWarning)
        result = quantize_qat_export(args.input, args.output, format=args.format, verify=not args.no_verify,
                                     inputs=inputs, input_shapes=shapes,
                                     tolerance=args.tolerance, thin=not args.no_thin,
                                     weight_type=args.weight_type, target=args.target,
                                     accuracy_level=args.accuracy_level,
                                     keep_exporter_metadata=args.keep_exporter_metadata, encodings=args.encodings)
    for w in caught:
        print(f"warning: {w.message}")
    done = ", ".join(f"{k} {v}" for k, v in result.rewrites.items() if v)
    print(f"wrote {result.path} ({result.path.stat().st_size / 1e6:.2f} MB) in {result.seconds:.2f}s: {done}")
    if result.avx2_path is not None:
        print(f"wrote {result.avx2_path} ({result.avx2_path.stat().st_size / 1e6:.2f} MB): for x86 without VNNI")
    print(result.weights_note)
    for note in (result.rounded_biases_note, result.masked_scores_note, result.grid_weights_note, *result.notes):
        if note:
            print(f"note: {note}")
    if result.verification is not None:
        print(f"verified in onnxruntime: {result.verification}")
    return 0
