"""keras.applications under recal's Keras QAT on each Keras backend: what becomes integer, and how close the int8
model stays.

Each model is built with ``weights=None`` (nothing downloaded) and a logits head at ``--size``, pruned 60% (every conv and
dense kernel) and QAT-trained with ``fit`` (the zoo test's recipe, ``--steps`` per epoch; BatchNorm momentum 0.9, as
Keras's 0.99 leaves the moving statistics near their start after a few dozen steps) on synthetic data it can learn
(ten class templates plus noise), finalized, exported with ``recal_keras.export_onnx`` (tf2onnx, jax2onnx or
torch.onnx) and converted by ``quantize_qat_export``. One table: the layers recal's Keras QAT quantizes and those it
leaves float, the integer ops of the int8 model (and the activations it looks up in tables of integers: hard-swish)
and the float ops the converter names between them (``result.unconverted``; the classifier's bias Add after the last
integer op is not among them), the Keras QAT model's accuracy, the int8 model's largest difference from it in its
output steps beside the same QAT model's run in onnxruntime's float kernels, argmax agreement on 256 new inputs of the
same classes (in a default onnxruntime session), the share of those inputs whose top two Keras logits lie within one
output step of each other (a one-step difference can flip their argmax), and what the converter's default check said.

Each backend runs in an interpreter of its own (``KERAS_BACKEND`` is read once, at import)::

    python scripts/bench_keras_applications.py [--backends tensorflow jax torch] [--size 32] [--steps 48] [--seed 0]
        [--models mobilenet_v2 resnet50 ...] [--json docs/results/keras_applications.json] [--update] [--keep DIR]
    python scripts/bench_keras_applications.py --json docs/results/keras_applications.json --rescore DIR
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from bench.results import load, save
from bench.suite import suite_module

ROOT = Path(__file__).resolve().parent.parent
BACKENDS = ("tensorflow", "jax", "torch")
MODELS = ("mobilenet_v2", "mobilenet_v3_small", "resnet50", "efficientnet_b0", "densenet121")
CLASSES = 10


def applications(keras) -> dict:
    """Each model of the zoo, a function of the input size."""
    head = {"weights": None, "classes": CLASSES, "classifier_activation": None}  # logits: compared on their int8 grid
    apps = keras.applications
    return {
        "mobilenet_v2": lambda s: apps.MobileNetV2((s, s, 3), alpha=0.35, **head),
        "mobilenet_v3_small": lambda s: apps.MobileNetV3Small((s, s, 3), include_preprocessing=False, **head),
        "resnet50": lambda s: apps.ResNet50(input_shape=(s, s, 3), **head),
        "efficientnet_b0": lambda s: apps.EfficientNetB0(input_shape=(s, s, 3), **head),
        "densenet121": lambda s: apps.DenseNet121(input_shape=(s, s, 3), **head),
    }


def templates(size: int, seed: int = 0):
    """A sampler of ``(x, y)``: ``x = template[y] + noise``, ten classes a model learns in a few dozen steps."""
    import numpy as np

    rng = np.random.default_rng(seed)
    base = rng.standard_normal((CLASSES, size, size, 3)).astype(np.float32)

    def sample(n: int):
        y = rng.integers(0, CLASSES, n)
        return base[y] + 0.5 * rng.standard_normal((n, size, size, 3)).astype(np.float32), y

    return sample


def run(name: str, size: int, folder: Path, steps: int, bn_momentum: float = 0.9, seed: int = 0) -> dict:
    """One model's row, on this process's Keras backend; ``seed``: the initial weights, the class templates and
    the data drawn from them."""
    import warnings

    import keras
    import numpy as np

    from recal_keras import RecalWarning, ScheduledModifierManager, export_onnx
    zoo = suite_module("tests.e2e.zoo.test_keras_applications")  # the zoo test's recipe
    BATCH, RECIPE = zoo.BATCH, zoo.RECIPE

    keras.utils.set_random_seed(seed)
    model = applications(keras)[name](size)
    for layer in model.layers:  # Keras's 0.99 leaves the moving statistics near their initial values after a few
        if isinstance(layer, keras.layers.BatchNormalization):  # dozen steps, and the model then predicts
            layer.momentum = bn_momentum  # one class for every input in inference
    manager = ScheduledModifierManager.from_yaml(RECIPE)
    optimizer = keras.optimizers.SGD(0.01, momentum=0.9)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", RecalWarning)
        qat, callbacks = manager.modify(model, optimizer, steps_per_epoch=steps)
    float_layers = [str(w.message).rpartition("): ")[2] for w in caught if "stay float" in str(w.message)]
    sample = templates(size, seed)
    x, y = sample(steps * BATCH)
    qat.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    qat.fit(x, y, batch_size=BATCH, epochs=2, callbacks=callbacks, verbose=0)
    manager.finalize(qat)
    test, labels = sample(256)
    expected = qat.predict(test, verbose=0)
    np.savez(folder / f"{name}.npz", test=test, expected=expected, labels=labels)  # kept with --keep
    export_onnx(qat, folder / f"{name}.onnx")
    return {"model": name, "size": size, "seed": seed, "quantized": len(manager.quantized_layers),
            "float_layers": ", ".join(float_layers) or "none", "steps": steps, **converted(folder, name),
            **compared(folder, name)}


def converted(folder: Path, name: str) -> dict:
    """``<name>.onnx`` converted by ``quantize_qat_export`` into ``<name>.int8.onnx``, verified on the kept test
    inputs: what became integer, what stayed float, and what the default check said."""
    import collections
    import math

    import numpy as np
    import onnx

    from recal_onnx import VerificationError, quantize_qat_export

    qdq = folder / f"{name}.onnx"
    feeds = {onnx.load(qdq).graph.input[0].name: np.load(folder / f"{name}.npz")["test"]}
    refused = None
    try:
        result = quantize_qat_export(qdq, folder / f"{name}.int8.onnx", verify_inputs=feeds)
    except VerificationError as exc:  # measured all the same: the row says it needed a tolerance, and why
        refused = str(exc).partition(": ")[2].partition("; nothing was written")[0]
        result = quantize_qat_export(qdq, folder / f"{name}.int8.onnx", verify_inputs=feeds, tolerance=math.inf)
    ops = collections.Counter(n.op_type for n in result.model.graph.node)
    return {"integer_ops": sum(n for op, n in ops.items() if op.startswith(("QLinear", "QGemm"))),
            "tables": result.rewrites.get("unary_to_table", 0),
            "float_ops": dict(sorted(collections.Counter(op for op, _ in result.unconverted).items())),
            "unconverted": len(result.unconverted), "within_noise": bool(result.verification.within_noise),
            "refused": refused, "int8_vs_qdq": str(result.verification)}


def compared(folder: Path, name: str) -> dict:
    """The int8 model and the QAT model's float run in onnxruntime against the Keras QAT model's outputs, from the
    files a run keeps (``<name>.int8.onnx``, ``<name>.onnx``, ``<name>.npz``)."""
    import numpy as np
    import onnxruntime as ort

    from recal_onnx import reference_session

    kept = np.load(folder / f"{name}.npz")
    test, expected, labels = kept["test"], kept["expected"], kept["labels"]
    session = ort.InferenceSession(str(folder / f"{name}.int8.onnx"))
    got = session.run(None, {session.get_inputs()[0].name: test})[0]
    qdq = reference_session(str(folder / f"{name}.onnx"))  # the same QAT model, in onnxruntime's float kernels
    as_float = qdq.run(None, {qdq.get_inputs()[0].name: test})[0]
    step = float(np.diff(np.unique(expected)).min()) if expected.size > 1 else 0.0
    top_two = np.sort(expected, axis=1)[:, -2:]
    return {"max_diff": float(np.abs(got - expected).max()), "output_step": step,
            "agreement": float((got.argmax(1) == expected.argmax(1)).mean()),
            "float_export_diff": float(np.abs(as_float - expected).max()),
            "float_export_agreement": float((as_float.argmax(1) == expected.argmax(1)).mean()),
            "accuracy": float((expected.argmax(1) == labels).mean()),
            "near_ties": float((top_two[:, 1] - top_two[:, 0] <= step * (1 + 1e-3)).mean())}


def rescored(data: dict, keep: Path) -> dict:
    """``data`` with each row converted and compared again from the QAT models ``--keep`` saved in ``keep`` (the
    training's own figures, its QAT layers, stay)."""
    for result in data["backends"]:
        for row in result["rows"]:
            folder = keep / result["backend"]
            if "error" not in row and (folder / f"{row['model']}.npz").exists():
                row.update(converted(folder, row["model"]))
                row.update(compared(folder, row["model"]))
    return data


def child(models: list[str], size: int, steps: int, keep: Path | None = None, seed: int = 0) -> dict:
    """Every model's row on this process's backend (a model that fails is a row that says why); ``keep``: a folder
    that keeps each model's QDQ and int8 exports and its test inputs with the Keras outputs (``.npz``)."""
    import contextlib
    import tempfile

    import keras
    import onnxruntime as ort

    rows = []
    with (contextlib.nullcontext(str(keep)) if keep else tempfile.TemporaryDirectory()) as tmp:
        for name in models:
            try:
                rows.append(run(name, size, Path(tmp), steps, seed=seed))
            except Exception as exc:  # noqa: BLE001 - a model that fails is a row that says why
                error = f"{type(exc).__name__}: {exc}".replace(f"{tmp}/", "")  # no temporary folder in the table
                rows.append({"model": name, "size": size, "error": error[:300]})
                print(f"{name}: {rows[-1]['error']}", file=sys.stderr)
    backend = keras.backend.backend()
    version = __import__("tensorflow" if backend == "tensorflow" else backend).__version__
    return {"backend": backend, "backend_version": version, "keras": keras.__version__,
            "onnxruntime": ort.__version__, "rows": rows}


def table(data: dict) -> str:
    """The results as a Markdown table (also what ``scripts/render_docs.py`` writes into the docs)."""
    lines = ["| backend | model | QAT layers | integer ops | float ops between integer ones | Keras QAT accuracy | "
             "int8 vs Keras QAT: max diff (output steps) | the QAT model in onnxruntime float vs Keras (output steps) "
             "| argmax agreement | top two within a step | converter's default check |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    refusals = []
    for result in data["backends"]:
        for r in result["rows"]:
            where = f"| {result['backend']} | {r['model']}"
            if "error" in r:
                lines.append(f"{where} | failed: {r['error']} | | | | | | | | |")
                continue
            floats = ", ".join(f"{op} x{n}" for op, n in r["float_ops"].items()) or "none"
            step = r["output_step"] or float("nan")
            float_export = (f"{r['float_export_diff']:.3g} ({r['float_export_diff'] / step:.2f})"
                            if "float_export_diff" in r else "not measured")
            if "float_export_agreement" in r:
                float_export += f", agreement {r['float_export_agreement']:.4f}"
            check = ("refused *" if r.get("refused") else
                     "passed, within the QAT model's rounding noise" if r.get("within_noise") else "passed")
            tables = f" + {r['tables']} tables" if r.get("tables") else ""
            lines.append(f"{where} ({r['size']}x{r['size']}) | {r['quantized']} | {r['integer_ops']}{tables} | "
                         f"{floats} | "
                         f"{100 * r['accuracy']:.1f}% | {r['max_diff']:.3g} ({r['max_diff'] / step:.2f}) | "
                         f"{float_export} | {r['agreement']:.4f} | {r['near_ties']:.4f} | {check} |")
            if r.get("refused"):
                refusals.append(f"{result['backend']} {r['model']}: {r['refused']}")
    first = data["backends"][0]
    versions = ", ".join(f"{r['backend']} {r['backend_version']}" for r in data["backends"])
    refused = "".join(f"\n\n\\* refused by `quantize_qat_export`'s default check ({r}), measured here with "
                      "`tolerance=inf`" for r in refusals)
    return ("\n".join(lines) + refused + "\n\nweights=None, a logits head, pruned 60% and QAT-trained for "
            f"{2 * data['steps']} "
            "steps with `fit` (batch 16, BatchNorm momentum 0.9) on ten learnable synthetic classes (templates plus "
            "noise); the int8 model against the Keras QAT model on 256 new inputs of those classes in a default "
            "session, beside the exported QAT model itself run in float by onnxruntime (two float runs of one model: "
            "how far kernels' rounding alone moves the outputs); accuracy: the Keras QAT model's on them; top two "
            "within a step: the inputs whose top two Keras logits are within one output step (a step's difference can "
            "flip them); the converter's check compares the int8 model with the exported QAT model (3 output steps, or "
            "that model's own rounding noise where every integer op matches op by op: docs/converter.md); "
            f"Keras {first['keras']} ({versions}), onnxruntime {first['onnxruntime']} "
            f"(`python scripts/bench_keras_applications.py --steps {data['steps']} "
            "--json docs/results/keras_applications.json`)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", nargs="+", default=list(BACKENDS), choices=BACKENDS)
    parser.add_argument("--size", type=int, default=32)
    parser.add_argument("--steps", type=int, default=48, help="steps per epoch (two epochs: pruning, then QAT)")
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    parser.add_argument("--seed", type=int, default=0, help="initial weights, class templates and data")
    parser.add_argument("--json", type=Path, help="also write the results to this file")
    parser.add_argument("--update", action="store_true",
                        help="with --json: replace only the rows of the backends and models run in that file's results")
    parser.add_argument("--keep", type=Path, help="keep each model's exports and test data in this folder "
                        "(<folder>/<backend>/<model>.onnx, .int8.onnx, .npz), to look into a row")
    parser.add_argument("--rescore", type=Path, metavar="KEEP",
                        help="train nothing: convert and compare --json's rows again from the QAT models a run kept "
                             "in KEEP (--keep), and write them back")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rescore:
        if not args.json:
            parser.error("--rescore needs --json (the results to measure again)")
        data = rescored(load(args.json), args.rescore)
        save(args.json, data)
        print(table(data))
        return 0
    if args.child:
        print(json.dumps(child(args.models, args.size, args.steps, args.keep, args.seed)))
        return 0
    saved = load(args.json) if args.update and args.json and args.json.exists() else None
    results = []
    for backend in args.backends:
        env = {**os.environ, "KERAS_BACKEND": backend, "TF_CPP_MIN_LOG_LEVEL": "3"}
        keep = []
        if args.keep:
            (args.keep / backend).mkdir(parents=True, exist_ok=True)
            keep = ["--keep", str((args.keep / backend).resolve())]
        out = subprocess.run([sys.executable, __file__, "--child", "--size", str(args.size), "--steps",
                              str(args.steps), "--seed", str(args.seed), "--models", *args.models, *keep], env=env, check=True, cwd=ROOT,
                             stdout=subprocess.PIPE, text=True).stdout
        results.append(json.loads(out.strip().splitlines()[-1]))
        data = {"size": args.size, "steps": args.steps, "seed": args.seed, "backends": results}
        if saved is not None:
            data = _updated(json.loads(json.dumps(saved)), data)
        if args.json:  # after each backend: a run cut short keeps what it measured
            save(args.json, data)
    print(table(data))
    return 0


def _updated(saved: dict, new: dict) -> dict:
    """``saved`` with each of ``new``'s rows in place of the row of the same backend and model (same settings)."""
    if (saved["size"], saved["steps"], saved.get("seed", 0)) != (new["size"], new["steps"], new["seed"]):
        raise SystemExit(f"--update: {saved['size']}px / {saved['steps']} steps / seed {saved.get('seed', 0)} saved, "
                         f"{new['size']}px / {new['steps']} steps / seed {new['seed']} run; run every model again "
                         "instead")
    for result in new["backends"]:
        old = next((b for b in saved["backends"] if b["backend"] == result["backend"]), None)
        if old is None:
            saved["backends"].append(result)
            continue
        fresh = {r["model"]: r for r in result["rows"]}
        old["rows"] = [fresh.pop(r["model"], r) for r in old["rows"]] + list(fresh.values())
    return saved


if __name__ == "__main__":
    sys.exit(main())
