"""``recal plan``: a PyTorch model's per-layer weight precision (``--scheme w8a8``: a CNN's int8 or float layers)
and pruning planned from measurement under a budget (bytes, bits per weight, milliseconds in onnxruntime on this CPU,
or a loss), written as an ordinary recipe (and the Pareto curve it was chosen on, as a plot).

The model comes from the user's own code, named as ``module:function`` (as ``uvicorn`` and ``gunicorn`` name an
app): the function is called with no arguments and returns the trained float ``nn.Module``. The calibration data is
an ``.npz`` file read without pickles: ``inputs`` and, for a classifier, ``labels`` (class indices; cross-entropy);
without labels, integer ``inputs`` of shape (samples, tokens) are token ids and the loss is next-token
cross-entropy (a decoder LM, its output the logits or an object with ``.logits``).
"""

from __future__ import annotations

import importlib
import os
import re
import sys
from pathlib import Path

from recal_core.atomic import write_text_atomically
from recal_core.input_gate import refuse_overwriting

from .report import save_figure_atomically

_UNITS = {"b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


def parse_budget(text: str) -> tuple[str, float]:
    """``size=2.5MB`` (bytes of the planned layers: weights, scales, biases), ``bits=4.5`` (bits per weight on
    average, scales counted), ``latency=2ms`` (the planned layers' summed time in onnxruntime) or ``loss=0.05`` (the
    summed loss increase: the smallest plan within it) as ``(kind, amount)``, amounts in bytes, bits, milliseconds
    or loss; a ValueError saying what is expected."""
    kind, _, value = text.partition("=")
    kind = kind.strip().lower()
    number = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-zµ]*)\s*", value.lower())
    if kind in ("bits", "loss"):
        amount = float(number.group(1)) if number and not number.group(2) else float("nan")
        if kind == "bits" and not 2 <= amount <= 32:
            raise ValueError(f"--budget bits={value}: expected bits per weight from 2 to 32, e.g. bits=4.5")
        if kind == "loss" and not amount >= 0:
            raise ValueError(f"--budget loss={value}: expected a summed loss increase of 0 or more, e.g. loss=0.05")
        return kind, amount
    if kind == "latency":
        unit = number.group(2) if number else ""
        scale = {"ms": 1.0, "s": 1e3, "us": 1e-3, "µs": 1e-3}.get(unit)
        if scale is None or float(number.group(1)) <= 0:
            raise ValueError(f"--budget {text!r}: expected latency=<time> with its unit (ms, us or s), e.g. "
                             "latency=2ms")
        return "latency", float(number.group(1)) * scale
    if kind != "size" or not number or (number.group(2) or "b") not in _UNITS:
        raise ValueError(f"--budget {text!r}: expected size=<bytes> (units B, kB, MB, GB, KiB, MiB, GiB; e.g. "
                         "size=2.5MB), bits=<bits per weight> (e.g. bits=4.5), latency=<time> (e.g. latency=2ms) "
                         "or loss=<summed loss increase> (e.g. loss=0.05)")
    return "size", float(number.group(1)) * _UNITS[number.group(2) or "b"]


def load_factory(spec: str):
    """The model ``module:function`` returns (the module found from the working folder first, as ``python -m``)."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr.isidentifier():
        raise ValueError(f"--model {spec!r}: expected module:function, e.g. mymodels:build (the function returns "
                         "the trained float torch.nn.Module)")
    sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        raise ValueError(f"--model {spec!r}: no module {exc.name!r} importable from {os.getcwd()}") from None
    finally:
        sys.path.remove(os.getcwd())
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise ValueError(f"--model {spec!r}: {module_name} has no function {attr!r}")
    import torch

    model = factory()
    if not isinstance(model, torch.nn.Module):
        kind = type(model)
        keras = any(c.__module__.split(".")[0] in ("keras", "tensorflow", "tf_keras") for c in kind.__mro__)
        why = ("a plan's weight-only 8/4/2-bit layers and per-layer scheme_overrides are not trained by recal_keras "
               "or recal_tf (they take W8A8 for every conv and dense layer, with no ignore list, and rank each "
               "layer's filters alone), so neither a mixed plan nor a w8a8 plan's float layers and coupled filter "
               "pruning could be trained there" if keras else "recal plan measures PyTorch models")
        raise ValueError(f"--model {spec!r}: {attr}() returned a {kind.__name__}, not a torch.nn.Module ({why}; "
                         "Keras models and TensorFlow graphs are not planned)")
    return model


def load_batches(path: str, batch_size: int):
    """``(batches, loss_fn)`` from the ``.npz`` at ``path`` (no pickles): see the module's docstring."""
    import numpy as np
    import torch

    try:
        with np.load(path, allow_pickle=False) as data:
            arrays = {k: data[k] for k in data.files}
    except (OSError, ValueError) as exc:
        raise ValueError(f"--data {path}: not a readable .npz file without pickles ({exc})") from None
    if "inputs" not in arrays:
        raise ValueError(f"--data {path}: expected an array named 'inputs' (and 'labels' for a classifier), found "
                         f"{', '.join(sorted(arrays)) or 'none'}")
    inputs, labels = arrays["inputs"], arrays.get("labels")
    if labels is not None and len(labels) != len(inputs):
        raise ValueError(f"--data {path}: {len(inputs)} inputs but {len(labels)} labels")
    if labels is None and not (np.issubdtype(inputs.dtype, np.integer) and inputs.ndim == 2):
        raise ValueError(f"--data {path}: 'inputs' without 'labels' are read as token ids, (samples, tokens) "
                         f"integers; these are {inputs.dtype} {inputs.shape}: give 'labels' (class indices)")

    def logits(model, x):
        out = model(x)
        return getattr(out, "logits", out)

    if labels is None:
        def loss_fn(model, batch):
            ids = batch[0]
            scores = logits(model, ids)[:, :-1]
            return torch.nn.functional.cross_entropy(scores.reshape(-1, scores.shape[-1]), ids[:, 1:].reshape(-1))
        tensors = [torch.from_numpy(inputs.astype(np.int64))]
    else:
        def loss_fn(model, batch):
            scores = logits(model, batch[0])
            return torch.nn.functional.cross_entropy(scores.reshape(-1, scores.shape[-1]), batch[1].reshape(-1))
        floats = inputs.astype(np.float32) if np.issubdtype(inputs.dtype, np.floating) else inputs.astype(np.int64)
        tensors = [torch.from_numpy(floats), torch.from_numpy(labels.astype(np.int64))]
    batches = [tuple(t[i:i + batch_size] for t in tensors) for i in range(0, len(inputs), batch_size)]
    return batches, loss_fn


def plot_curve(plan, path: str | os.PathLike) -> Path:
    """The Pareto curve (least summed score at each size, or at each latency) and the chosen plan on it, as a PNG
    (atomically)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    timed = plan.cost == "latency"
    scale, unit = (1.0, "ms, summed, each layer timed alone in onnxruntime") if timed else (1e-6, "MB")
    fig, ax = plt.subplots(figsize=(7, 4.5))
    costs, scores = zip(*plan.curve)
    ax.plot([c * scale for c in costs], scores, "o-", label=f"best plan at each {'latency' if timed else 'size'}")
    spent = plan.latency if timed else plan.size
    ax.plot([spent * scale], [sum(c.score for c in plan.choice.values())], "r*", markersize=14,
            label="the plan written")
    ax.set_xlabel(f"planned layers, {unit}")
    ax.set_ylabel("summed score (estimated loss increase)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    return save_figure_atomically(fig, path)


def plan(args) -> int:
    """The ``recal plan`` command."""
    from recal_torch import plan_precision

    budgets = dict(parse_budget(text) for text in args.budget)
    if len(budgets) != len(args.budget) or len(budgets) > 2 or (len(budgets) == 2 and (
            "latency" not in budgets or "loss" in budgets)):
        raise ValueError(f"--budget {' --budget '.join(args.budget)}: give one budget, or latency=... with one of "
                         "size=... or bits=...")
    refuse_overwriting(args.output, [args.data], "recipe")
    if args.plot:
        refuse_overwriting(args.plot, [args.data, args.output], "plot")
    if (args.rows or args.accuracy_level) and "latency" not in budgets:
        raise ValueError("--rows / --accuracy-level: how a layer is timed counts only with --budget latency=...")
    batches, loss_fn = load_batches(args.data, args.batch_size)
    model = load_factory(args.model)
    names = {"size": "budget", "bits": "bits_budget", "latency": "latency_budget", "loss": "loss_budget"}
    timer = None
    if "latency" in budgets:
        from functools import partial

        from recal_onnx import timed_candidates

        timer = partial(timed_candidates, rows=args.rows, accuracy_level=args.accuracy_level)
    result = plan_precision(model, batches, loss_fn, score=args.score, group_size=args.group_size,
                            prune_levels=args.prune_levels, scheme=args.scheme, reduce_range=args.reduce_range,
                            epochs=args.epochs, progress=not args.no_progress, timer=timer,
                            **{names[kind]: amount for kind, amount in budgets.items()})
    write_text_atomically(args.output, result.recipe)
    for name, why in result.left_out.items():
        print(f"left out: {name}: {why}")
    held = {}
    for candidate in result.choice.values():
        held[candidate.bits] = held.get(candidate.bits, 0) + 1
    int8 = args.scheme == "w8a8"
    said = ", ".join(f"{n} {'float' if b == 32 else 'int8' if int8 else f'at {b} bits'}"
                     for b, n in sorted(held.items()))
    thinned = sum(1 for c in result.choice.values() if c.sparsity or c.in_sparsity)
    said += f"; {thinned} thinned (recal_torch.thin after training)" if thinned else ""
    took = "" if result.latency is None else f", {result.latency:.4g} ms in onnxruntime here"
    print(f"planned {len(result.choice)} layers ({said}), {result.size / 1e6:.3f} MB, {result.macs / 1e6:.4g} M "
          f"multiply-adds a sample{took}; wrote {args.output} (check it: recal check {args.output})")
    if args.plot:
        print(f"wrote {plot_curve(result, args.plot)}")
    return 0
