"""keras.applications under recal's Keras QAT: what becomes integer, and how close the int8 model stays.

Each model is built with ``weights=None`` (nothing downloaded) and a logits head at ``--size``, pruned 60% (every conv and
dense kernel) and QAT-trained with ``fit`` (the zoo test's recipe, ``--steps`` per epoch) on synthetic data it can learn
(ten class templates plus noise, so its logits separate as a trained model's do), finalized, exported with
``recal_tf.keras.export_onnx`` and converted by ``quantize_qat_export``. One table: the layers recal's Keras QAT
quantizes and those it leaves float, the integer ops of the int8 model and the float ops the converter names
between them (``result.unconverted``; the classifier's bias Add after the last integer op is not among them), the int8
model's largest difference from the Keras QAT model in that model's output steps, and argmax agreement on 256
new inputs of the same classes (in a default onnxruntime session) beside the share of those inputs whose top two Keras logits lie within
one output step of each other (a one-step difference can flip their argmax).

    python scripts/bench_keras_applications.py [--size 32] [--steps 16] [--models mobilenet_v2 resnet50 ...]
        [--json docs/results/keras_applications.json]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import tempfile
import warnings
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import keras  # noqa: E402
import numpy as np  # noqa: E402
import onnx  # noqa: E402
import onnxruntime as ort  # noqa: E402

from recal_onnx import quantize_qat_export  # noqa: E402
from recal_tf.keras import RecalWarning, ScheduledModifierManager, export_onnx  # noqa: E402
from tests.zoo.test_keras_applications import BATCH, RECIPE  # noqa: E402 - the zoo test's recipe

CLASSES = 10
HEAD = {"weights": None, "classes": CLASSES, "classifier_activation": None}  # logits: compared on their int8 grid
APPLICATIONS = {
    "mobilenet_v2": lambda s: keras.applications.MobileNetV2((s, s, 3), alpha=0.35, **HEAD),
    "mobilenet_v3_small": lambda s: keras.applications.MobileNetV3Small((s, s, 3), include_preprocessing=False,
                                                                        **HEAD),
    "resnet50": lambda s: keras.applications.ResNet50(input_shape=(s, s, 3), **HEAD),
    "efficientnet_b0": lambda s: keras.applications.EfficientNetB0(input_shape=(s, s, 3), **HEAD),
    "densenet121": lambda s: keras.applications.DenseNet121(input_shape=(s, s, 3), **HEAD),
}


def templates(size: int, seed: int = 0):
    """A sampler of ``(x, y)``: ``x = template[y] + noise``, ten classes a model learns in a few steps."""
    rng = np.random.default_rng(seed)
    base = rng.standard_normal((CLASSES, size, size, 3)).astype(np.float32)

    def sample(n: int):
        y = rng.integers(0, CLASSES, n)
        return base[y] + 0.5 * rng.standard_normal((n, size, size, 3)).astype(np.float32), y

    return sample


def run(name: str, size: int, folder: Path, steps: int) -> dict:
    """One model's row."""
    keras.utils.set_random_seed(0)
    model = APPLICATIONS[name](size)
    manager = ScheduledModifierManager.from_yaml(RECIPE)
    optimizer = keras.optimizers.SGD(0.01, momentum=0.9)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", RecalWarning)
        qat, callbacks = manager.modify(model, optimizer, steps_per_epoch=steps)
    float_layers = [str(w.message).rpartition("): ")[2] for w in caught if "stay float" in str(w.message)]
    sample = templates(size)
    x, y = sample(steps * BATCH)
    qat.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    qat.fit(x, y, batch_size=BATCH, epochs=2, callbacks=callbacks, verbose=0)
    manager.finalize(qat)
    test, labels = sample(256)
    expected = qat.predict(test, verbose=0)
    qdq = export_onnx(qat, folder / f"{name}.onnx")
    feeds = {onnx.load(qdq).graph.input[0].name: test}
    result = quantize_qat_export(qdq, folder / f"{name}.int8.onnx", verify_inputs=feeds)
    ops = collections.Counter(n.op_type for n in result.model.graph.node)
    session = ort.InferenceSession(str(folder / f"{name}.int8.onnx"))
    got = session.run(None, {session.get_inputs()[0].name: test})[0]
    step = float(np.diff(np.unique(expected)).min()) if expected.size > 1 else 0.0
    top_two = np.sort(expected, axis=1)[:, -2:]
    return {"model": name, "size": size, "quantized": len(manager.quantized_layers),
            "float_layers": ", ".join(float_layers) or "none",
            "integer_ops": sum(n for op, n in ops.items() if op.startswith(("QLinear", "QGemm"))),
            "float_ops": dict(sorted(collections.Counter(op for op, _ in result.unconverted).items())),
            "unconverted": len(result.unconverted),
            "max_diff": float(np.abs(got - expected).max()), "output_step": step,
            "agreement": float((got.argmax(1) == expected.argmax(1)).mean()), "steps": steps,
            "accuracy": float((expected.argmax(1) == labels).mean()),
            "near_ties": float((top_two[:, 1] - top_two[:, 0] <= step * (1 + 1e-3)).mean())}


def format_table(rows: list[dict]) -> str:
    lines = ["| model | QAT layers | layers left float | integer ops | float ops between integer ones | Keras QAT "
             "accuracy | max diff (output steps) | argmax agreement | top two within a step |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        steps = r["max_diff"] / r["output_step"] if r["output_step"] else float("nan")
        floats = ", ".join(f"{op} x{n}" for op, n in r["float_ops"].items()) or "none"
        lines.append(f"| {r['model']} ({r['size']}x{r['size']}) | {r['quantized']} | {r['float_layers'][:60]} | "
                     f"{r['integer_ops']} | {floats} | {100 * r['accuracy']:.1f}% | {r['max_diff']:.3g} ({steps:.2f}) | "
                     f"{r['agreement']:.4f} | {r['near_ties']:.4f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=32)
    parser.add_argument("--steps", type=int, default=16, help="steps per epoch (two epochs: pruning, then QAT)")
    parser.add_argument("--models", nargs="+", default=list(APPLICATIONS), choices=list(APPLICATIONS))
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models:
            try:
                rows.append(run(name, args.size, Path(tmp), args.steps))
            except Exception as exc:  # noqa: BLE001 - a model that fails is a row that says why
                error = f"{type(exc).__name__}: {exc}".replace(f"{tmp}/", "")  # no temporary folder in the table
                rows.append({"model": name, "size": args.size, "error": error[:300]})
                print(f"{name}: {rows[-1]['error']}", file=sys.stderr)
    print(format_table([r for r in rows if "error" not in r]))
    for r in rows:
        if "error" in r:
            print(f"{r['model']}: failed: {r['error']}")
    if args.json:
        Path(args.json).write_text(json.dumps({"keras": keras.__version__, "onnxruntime": ort.__version__,
                                               "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
