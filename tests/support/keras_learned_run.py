"""Learned scales (``observer: lsq``) on the digits net with ``recal_keras`` on whichever Keras backend this process
runs, for :mod:`tests.keras.test_keras_backends`: the run through, the same run resumed from the ``.keras`` file
``ModelCheckpoint`` wrote during QAT, and the finalized model's int8 conversion, written to an ``.npz``.

``KERAS_BACKEND=jax python -m tests.support.keras_learned_run OUT.npz``; the test runs TensorFlow's in its own process.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import numpy as np

from tests.support.keras_backend_run import _digits_net

RECIPE = """
- !EpochRangeModifier {start_epoch: 0.0, end_epoch: 4.0}
- !QuantizationModifier
  start_epoch: 1.0
  freeze_bn_stats_epoch: 3.0
  disable_quantization_observer_epoch: 3.5
  scheme: {input_activations: {symmetric: false, observer: lsq}, weights: {observer: lsq}}
"""
STEPS_PER_EPOCH, BATCH = 8, 32


def run(out: str) -> None:
    import keras

    from recal_core.datasets import load_digits
    from recal_onnx import quantize_qat_export
    from recal_keras import ScheduledModifierManager, export_onnx

    digits = load_digits()
    x, y = digits.train_images[: STEPS_PER_EPOCH * BATCH, ..., None], digits.train_labels[: STEPS_PER_EPOCH * BATCH]
    xt = digits.test_images[..., None]

    def modified(model=None):
        manager = ScheduledModifierManager.from_yaml(RECIPE)
        optimizer = keras.optimizers.AdamW(1e-3, weight_decay=0.01) if model is None else model.optimizer
        qat, callbacks = manager.modify(model or _digits_net(), optimizer, steps_per_epoch=STEPS_PER_EPOCH)
        if model is None:
            qat.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return manager, qat, callbacks

    fit = {"x": x, "y": y, "batch_size": BATCH, "verbose": 0, "shuffle": False}
    manager, whole, callbacks = modified()
    excluded = [v.path for v in whole.trainable_weights if not whole.optimizer._use_weight_decay(v)]
    with tempfile.TemporaryDirectory() as folder:
        saver = keras.callbacks.ModelCheckpoint(str(Path(folder) / "epoch-{epoch}.keras"))
        whole.fit(epochs=4, callbacks=callbacks + [saver], **fit)
        ratios = {v.path: v.numpy().copy() for v in whole.weights if v.name == "log_ratio"}
        _, resumed, callbacks = modified(keras.models.load_model(Path(folder) / "epoch-2.keras"))
        resumed.fit(epochs=4, initial_epoch=2, callbacks=callbacks, **fit)
        differs = {a.path: float(np.abs(a.numpy() - b.numpy()).max()) for a, b in zip(whole.weights, resumed.weights)
                   if a.name != "recal_step"}  # (JAX's step count, not saved: recal's callback sets it)
        manager.finalize(whole)
        keras_classes = whole.predict(xt, verbose=0).argmax(1)
        path = export_onnx(whole, Path(folder) / "lsq.onnx")
        result = quantize_qat_export(path, Path(folder) / "lsq.int8.onnx")
        import onnxruntime as ort

        session = ort.InferenceSession(str(Path(folder) / "lsq.int8.onnx"))
        int8_classes = session.run(None, {session.get_inputs()[0].name: xt})[0].argmax(1)
    np.savez(out, backend=keras.backend.backend(), names=np.array(list(ratios)),
             moved=np.array([float(np.abs(r).max()) for r in ratios.values()]),
             excluded=np.array(excluded), resume_difference=max(differs.values()), worst=max(differs, key=differs.get), float_ops=str(dict(result.float_ops)),
             verified=result.verification.problem(None) is None, agreement=float((int8_classes == keras_classes).mean()),
             accuracy=float((keras_classes == digits.test_labels).mean()))


if __name__ == "__main__":
    run(sys.argv[1])
