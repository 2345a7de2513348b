"""``recal plan``: a PyTorch model's per-layer weight precision planned from measurement under a budget, written as an
ordinary recipe (and the Pareto curve it was chosen on, as a plot).

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
    """``size=2.5MB`` (bytes of the planned layers: weights, scales, biases) or ``bits=4.5`` (bits per weight on
    average, scales counted) as ``("size", bytes)`` or ``("bits", bits)``; a ValueError saying what is expected."""
    kind, _, value = text.partition("=")
    kind = kind.strip().lower()
    if kind == "latency":
        raise ValueError("--budget latency=...: recal plans against size or bits per weight; onnxruntime latency "
                         "per layer is not measured yet (MatMulNBits at 2 and 8 bits runs slower than at 4 here, so "
                         "fewer bytes is not less time): give size=... or bits=...")
    if kind == "bits":
        try:
            bits = float(value)
        except ValueError:
            bits = float("nan")
        if not 2 <= bits <= 32:
            raise ValueError(f"--budget bits={value}: expected bits per weight from 2 to 32, e.g. bits=4.5")
        return "bits", bits
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-z]*)\s*", value.lower())
    if kind != "size" or not match or (match.group(2) or "b") not in _UNITS:
        raise ValueError(f"--budget {text!r}: expected size=<bytes> (units B, kB, MB, GB, KiB, MiB, GiB; e.g. "
                         "size=2.5MB) or bits=<bits per weight> (e.g. bits=4.5)")
    return "size", float(match.group(1)) * _UNITS[match.group(2) or "b"]


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
        raise ValueError(f"--model {spec!r}: {attr}() returned a {type(model).__name__}, not a torch.nn.Module "
                         "(recal plan measures PyTorch models; Keras models and TensorFlow graphs are not planned "
                         "yet: write their QuantizationModifier by hand)")
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
    """The Pareto curve (least summed score at each size) and the chosen plan on it, as a PNG (atomically)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    costs, scores = zip(*plan.curve)
    ax.plot([c / 1e6 for c in costs], scores, "o-", label="best plan at each size")
    chosen = sum(c.cost for c in plan.choice.values()), sum(c.score for c in plan.choice.values())
    ax.plot([chosen[0] / 1e6], [chosen[1]], "r*", markersize=14, label="the plan written")
    ax.set_xlabel("planned layers, MB")
    ax.set_ylabel("summed score (estimated loss increase)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    return save_figure_atomically(fig, path)


def plan(args) -> int:
    """The ``recal plan`` command."""
    from recal_torch import plan_precision

    kind, amount = parse_budget(args.budget)
    refuse_overwriting(args.output, [args.data], "recipe")
    if args.plot:
        refuse_overwriting(args.plot, [args.data, args.output], "plot")
    batches, loss_fn = load_batches(args.data, args.batch_size)
    model = load_factory(args.model)
    budget = {"budget": amount} if kind == "size" else {"bits_budget": amount}
    result = plan_precision(model, batches, loss_fn, score=args.score, group_size=args.group_size,
                            epochs=args.epochs, progress=not args.no_progress, **budget)
    write_text_atomically(args.output, result.recipe)
    for name, why in result.left_out.items():
        print(f"left out: {name}: {why}")
    held = {}
    for candidate in result.choice.values():
        held[candidate.bits] = held.get(candidate.bits, 0) + 1
    said = ", ".join(f"{n} {'float' if b == 32 else f'at {b} bits'}" for b, n in sorted(held.items()))
    print(f"planned {len(result.choice)} layers ({said}), "
          f"{sum(c.cost for c in result.choice.values()) / 1e6:.3f} MB; wrote {args.output} "
          f"(check it: recal check {args.output})")
    if args.plot:
        print(f"wrote {plot_curve(result, args.plot)}")
    return 0
