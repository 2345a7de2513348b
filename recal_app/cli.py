"""The ``recal`` command line.

``check`` and ``schema`` need only recal_core; ``train`` imports the framework it trains with, when it runs;
``quantize-qat-export`` is :mod:`recal_onnx.cli`'s (left out, with a note under ``-v``, where onnx is not
installed). Every failure ends with one clear line and a non-zero exit.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import threading
from typing import Sequence

from recal_core.atomic import write_text_atomically
from recal_core.errors import RecipeError, VerificationError
from recal_core.input_gate import refuse_overwriting
from recal_core.recipe import load_recipe, recipe_json_schema

from .report import format_table, plot_schedule

log = logging.getLogger(__name__)

EXIT_VERIFICATION_FAILED = 1
EXIT_BAD_INPUT = 2
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as shells report it
EXIT_TERMINATED = 143  # 128 + SIGTERM


def _check(args: argparse.Namespace) -> int:
    recipe = load_recipe(args.recipe)
    schedule = recipe.bind(args.steps_per_epoch)
    print(format_table(schedule))
    if args.plot:
        refuse_overwriting(args.plot, [args.recipe], "plot")
        path = plot_schedule(schedule, args.plot)
        print(f"wrote {path}")
    return 0


def _train(args: argparse.Namespace) -> int:
    from .training import ARTEFACT_HEADER, artefact_row, train

    recipe = load_recipe(args.recipe)
    run = train(recipe, args.framework, args.output, epochs=args.epochs, seed=args.seed, resume=args.resume,
                progress=not args.no_progress)
    print(f"\n{args.framework}: trained {run.epochs} epochs under {args.recipe}")
    print(ARTEFACT_HEADER)
    for artefact in run.artefacts:
        print(artefact_row(artefact))
    print(f"report: {args.output}/report.md, plot: {args.output}/schedule.png, "
          f"TensorBoard: tensorboard --logdir {args.output}/tensorboard")
    return 0


def _demo(args: argparse.Namespace) -> int:
    from .demo import demo

    demo(args.output, seed=args.seed, progress=not args.no_progress,
         frameworks=tuple(args.framework or ("torch", "tf")))
    return 0


def _shares(text: str) -> tuple[float, ...]:
    try:
        shares = tuple(float(part) for part in text.split(","))
    except ValueError:
        shares = ()
    if not shares or not all(0 < share < 1 for share in shares):
        raise argparse.ArgumentTypeError(f"expected shares above 0 and below 1, comma-separated (e.g. 0.25,0.5), "
                                         f"got {text!r}")
    return shares


def _plan(args: argparse.Namespace) -> int:
    from .plan import plan

    return plan(args)


def _schema(args: argparse.Namespace) -> int:
    text = json.dumps(recipe_json_schema(), indent=2) + "\n"
    if args.output:
        write_text_atomically(args.output, text)
        print(f"wrote {args.output}")
    else:
        sys.stdout.write(text)
    return 0


def _version() -> str:
    """The installed distribution's version (the checkout's pyproject.toml where it is not installed)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("recal")
    except PackageNotFoundError:
        return "(not installed)"


def _recipes(args: argparse.Namespace) -> int:
    from recal_core.bundled import PREFIX, bundled_recipes

    found = bundled_recipes()
    width = max(len(PREFIX + name) for name in found)
    for name, about in found.items():
        print(f"{PREFIX + name:<{width}}  {about}")
    return 0


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line on stderr (and exit 2), like every other failure."""

    def error(self, message: str):
        self.exit(EXIT_BAD_INPUT, f"{self.prog}: {' '.join(message.split())} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="recal", description="Scheduled pruning, QAT and LR recipes for PyTorch, Keras 3 and "
                                                "TensorFlow; QAT exports converted to integer ONNX, verified.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log debug messages")
    parser.add_argument("--version", action="version", version=f"recal {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)

    check = sub.add_parser("check", help="validate a recipe and print what it does per epoch")
    check.add_argument("recipe", help="recipe file (.yaml or .md with front matter), or a bundled one: recal:NAME")
    check.add_argument("--steps-per-epoch", type=_steps_per_epoch, default=1,
                       help="optimizer steps per epoch (default 1: one row per epoch step)")
    check.add_argument("--plot", metavar="OUT.png", help="also write the sparsity and LR curves")
    check.set_defaults(func=_check)

    train = sub.add_parser("train", help="train the bundled digits classifier under a recipe (PyTorch, Keras 3 or "
                                         "TensorFlow)")
    train.add_argument("--framework", choices=("torch", "tf", "keras"), required=True,
                       help="torch (PyTorch), keras (Keras 3, its configured backend) or tf (a TensorFlow graph)")
    train.add_argument("--recipe", required=True, help="recipe file, or a bundled one: recal:NAME (recal recipes)")
    train.add_argument("--output", default="runs/recal", help="output folder (default runs/recal)")
    train.add_argument("--epochs", type=_positive_int, help="epochs to train (default: the recipe's max_epochs)")
    train.add_argument("--seed", type=int, default=0, help="seed of the weights and the data order (default 0)")
    train.add_argument("--resume", action="store_true", help="continue from the last checkpoint in --output")
    train.add_argument("--no-progress", action="store_true", help="no progress bars")
    train.set_defaults(func=_train)

    demo = sub.add_parser("demo", help="the main job on the bundled digits: one recipe (recal:prune_quant) in "
                                       "PyTorch and TensorFlow, exported and converted to int8, verified")
    demo.add_argument("--output", default="demo_out", help="output folder (default demo_out)")
    demo.add_argument("--seed", type=int, default=0, help="seed of the weights and the data order (default 0)")
    demo.add_argument("--framework", choices=("torch", "tf"), action="append",
                      help="train only with this framework (repeatable; default: each one installed)")
    demo.add_argument("--no-progress", action="store_true", help="no progress bars")
    demo.set_defaults(func=_demo, framework=None)

    planner = sub.add_parser("plan", help="plan each layer's precision (and pruning) of a PyTorch model under a "
                                          "budget, from measurement on your data, and write it as a recipe")
    planner.add_argument("--model", required=True, metavar="MODULE:FUNCTION",
                         help="your code: FUNCTION() returns the trained float torch.nn.Module (MODULE importable "
                              "from the working folder)")
    planner.add_argument("--data", required=True, metavar="DATA.npz",
                         help="calibration data: 'inputs' and 'labels' (a classifier), or 'inputs' alone as token ids "
                              "(a decoder LM); read without pickles")
    planner.add_argument("--budget", required=True, action="append",
                         help="size=<bytes of the planned layers> (e.g. size=2.5MB), bits=<bits per weight> "
                              "(e.g. bits=4.5), latency=<the planned layers' time in onnxruntime on this CPU> "
                              "(e.g. latency=2ms) or loss=<summed loss increase> (e.g. loss=0.05: the smallest plan "
                              "within it); latency and a size (or bits) may be given together, twice --budget")
    planner.add_argument("--rows", type=_positive_int, default=None,
                         help="with latency=: time each layer at this many input rows (1: a decoder's one-token "
                              "step; default: one sample of --data)")
    planner.add_argument("--prune-levels", type=_shares, default=(), metavar="S1,S2,...",
                         help="also plan pruning: the shares of each prunable channel space (a gated MLP's hidden "
                              "channels) its layers may lose, e.g. 0.25,0.5; the recipe prunes them (mask_type: "
                              "filter) and recal_torch.thin removes them after training")
    planner.add_argument("--accuracy-level", type=int, choices=(0, 1, 2, 3, 4), default=0,
                         help="with latency=: time MatMulNBits at this accuracy level, the one you will convert with "
                              "(recal quantize-qat-export --accuracy-level; default 0: float arithmetic, exact)")
    planner.add_argument("--score", choices=("measured", "fisher"), default="measured",
                         help="measured: each layer alone quantized, the loss increase (default); fisher: the "
                              "cheap estimate, one backward pass per batch")
    planner.add_argument("--scheme", choices=("weight-only", "w8a8"), default="weight-only",
                         help="weight-only (default): each Linear's weights at 8, 4 or 2 bits or float; w8a8 (a CNN): "
                              "each Conv1d, Conv2d and Linear in int8, weights and inputs, or float")
    planner.add_argument("--reduce-range", action="store_true",
                         help="with --scheme w8a8: 7-bit weights, exact on every x86 CPU with or without VNNI")
    planner.add_argument("--group-size", type=int, default=32,
                         help="weights per scale (default 32; 0: per channel; w8a8: per channel)")
    planner.add_argument("--epochs", type=float, default=1.0, help="QAT epochs the recipe schedules (default 1)")
    planner.add_argument("--batch-size", type=_positive_int, default=8, help="calibration batch size (default 8)")
    planner.add_argument("--output", "-o", default="plan.yaml", help="the recipe written (default plan.yaml)")
    planner.add_argument("--plot", metavar="OUT.png", help="also write the Pareto curve with the chosen plan")
    planner.add_argument("--no-progress", action="store_true", help="no progress bar")
    planner.set_defaults(func=_plan)

    recipes = sub.add_parser("recipes", help="list the recipes recal ships (use one as recal:NAME)")
    recipes.set_defaults(func=_recipes)

    schema = sub.add_parser("schema", help="print the JSON Schema of the recipe format")
    schema.add_argument("--output", "-o", help="write it to this file instead of stdout")
    schema.set_defaults(func=_schema)

    try:
        from recal_onnx.cli import register
    except ImportError as exc:  # recal installed without its onnx extra
        log.debug("recal quantize-qat-export unavailable: %s", exc)
    else:
        register(sub)
    return parser


def _steps_per_epoch(text: str) -> int:
    value = _positive_int(text)
    if value > 10**9:
        raise argparse.ArgumentTypeError(f"expected at most 1,000,000,000 steps per epoch, got {value}")
    return value


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def main(argv: Sequence[str] | None = None) -> int:
    """The ``recal`` command: run it on ``argv``; return its exit status (0, 1 for a failed verification, 2 for
    input it cannot take, 130 when interrupted).

    Args:
        argv: the command line after ``recal`` (``sys.argv[1:]`` when None).
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")  # other libraries: warnings only
    for name in ("recal", "recal_core", "recal_torch", "recal_keras", "recal_tf", "recal_onnx"):
        logging.getLogger(name).setLevel(logging.DEBUG if args.verbose else logging.INFO)
    previous = _on_sigterm_raise()
    try:
        return int(args.func(args) or 0)
    except RecipeError as exc:
        if args.command == "check" or len(exc.problems) == 1:
            _fail(args, f"invalid recipe: {exc}")
        else:  # one line; `recal check` lists them all
            _fail(args, f"invalid recipe: {exc.problems[0]} (and {len(exc.problems) - 1} more "
                        f"problems: run `recal check` on the recipe to list them)")
    except VerificationError as exc:
        _fail(args, str(exc))
        return EXIT_VERIFICATION_FAILED
    except KeyboardInterrupt as exc:
        kept = "; the last complete checkpoint is kept (continue with --resume)" if args.command == "train" else ""
        terminated = isinstance(exc, Terminated)
        _fail(args, f"{'terminated (SIGTERM)' if terminated else 'interrupted'}{kept}")
        return EXIT_TERMINATED if terminated else EXIT_INTERRUPTED
    except ImportError as exc:
        name = getattr(exc, "name", None) or str(exc)
        _fail(args, f"needs the Python package {name!r}, which is not installed "
                    "(pip install 'recal[torch]', 'recal[tf-cpu]' or 'recal[onnx]', as the command needs)")
    except MemoryError:
        _fail(args, "out of memory")
    except (ValueError, OSError, RuntimeError, TypeError) as exc:
        _fail(args, str(exc))
    except Exception as exc:  # the command line's contract: one line, never a traceback
        if args.verbose:
            raise
        _fail(args, f"internal error ({type(exc).__name__}: {exc}); run with -v for the traceback and please "
                    "report it")
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    return EXIT_BAD_INPUT


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the command runs: it ends as Ctrl-C does (temporaries removed, one line, an exit code)."""


def _on_sigterm_raise():
    """SIGTERM raises :class:`Terminated` (in the main thread; elsewhere nothing changes); the previous handler."""
    if threading.current_thread() is not threading.main_thread():
        return None

    def handler(signum, frame):
        raise Terminated()

    return signal.signal(signal.SIGTERM, handler)


def _fail(args: argparse.Namespace, message: str) -> None:
    """One line on stderr (a message that spans lines is folded onto one)."""
    text = message if args.command == "check" else " ".join(message.split())
    print(f"recal {args.command}: {text}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
