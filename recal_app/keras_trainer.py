"""The Keras trainer behind ``recal train --framework keras``: the digits classifier under a recipe.

``modify`` / ``compile`` / ``fit`` as a Keras user writes them, one ``fit`` per epoch on the epoch's batch
order; a ``tf.train.Checkpoint`` of model and optimizer per epoch (``--resume`` rebuilds the model, applies the
recipe and restores it, so the schedule continues exactly; a ``.keras`` file cannot hold recal's QAT layers);
TensorBoard through Keras's own callback plus recal's scalars; at the end ``finalize`` and an ONNX export
(QDQ after QAT, which ``recal train`` then converts to int8).
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import keras
import tensorflow as tf

from recal_core.atomic import write_text_atomically
from recal_core.datasets import load_digits
from recal_core.recipe import Recipe
from .keras_digits import digits_model
from .run_lock import read_resume_record, restore_checkpoint
from .training import (BATCH_SIZE, LEARNING_RATE, Artefact, EpochRecord, TrainingRun, check_finite, epoch_line,
                        epoch_order, overall_sparsity)

from recal_keras import ScheduledModifierManager, describe_model, export_onnx

log = logging.getLogger(__name__)
CHECKPOINT = "model.ckpt"


class _Scalars(keras.callbacks.Callback):
    """recal's scalars (LR, each pruned layer's sparsity) in TensorBoard, once per epoch."""

    def __init__(self, manager: ScheduledModifierManager, log_dir: Path):
        super().__init__()
        self.manager, self.writer = manager, tf.summary.create_file_writer(str(log_dir / "recal"))

    def on_epoch_end(self, epoch, logs=None):
        step = int(self.model.optimizer.iterations.numpy())
        with self.writer.as_default():
            for name, value in self.manager.scalars().items():
                tf.summary.scalar(name, value, step=step)
        self.writer.flush()


class _FirstNonFinite(keras.callbacks.Callback):
    """Stops ``fit`` at the first batch whose loss is not finite, and remembers its step and loss."""

    def __init__(self):
        super().__init__()
        self.step: int | None = None
        self.loss: float | None = None

    def on_train_batch_end(self, batch, logs=None):
        loss = (logs or {}).get("loss")
        if self.step is None and loss is not None and not math.isfinite(float(loss)):
            self.step, self.loss = int(keras.ops.convert_to_numpy(self.model.optimizer.iterations)), float(loss)
            self.model.stop_training = True


def _kernel_sparsity(model: keras.Model) -> tuple[float, dict[str, float]]:
    """Zero fraction of the conv / dense kernels (as the core selects them), overall and per kernel."""
    infos, by_name = describe_model(model)
    kernels = {p.name: by_name[p.name].numpy() for p in infos if p.prunable}
    layers = {name: float((v == 0).mean()) for name, v in kernels.items()}
    return overall_sparsity(layers, {name: v.size for name, v in kernels.items()}), layers


def train(recipe: Recipe, out_dir: Path, *, epochs: int, seed: int, resume: bool, progress: bool) -> TrainingRun:
    digits = load_digits()
    x_train, y_train = digits.train_images[..., None], digits.train_labels
    x_test, y_test = digits.test_images[..., None], digits.test_labels
    steps_per_epoch = math.ceil(len(x_train) / BATCH_SIZE)
    run = TrainingRun("keras", recipe.source, str(out_dir), epochs, seed, steps_per_epoch)
    ckpt_dir = out_dir / "checkpoints"
    model = digits_model(seed)
    optimizer = keras.optimizers.SGD(LEARNING_RATE, momentum=0.9)
    manager = ScheduledModifierManager(recipe)
    model, callbacks = manager.modify(model, optimizer, steps_per_epoch=steps_per_epoch)
    model.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    checkpoint = tf.train.Checkpoint(model=model, optimizer=optimizer)
    start = 0
    if resume:
        state = read_resume_record(ckpt_dir / "history.json", ("epoch", "checkpoint", "history"))
        if "/" in state["checkpoint"] or not (ckpt_dir / (state["checkpoint"] + ".index")).is_file():
            raise FileNotFoundError(f"--resume: {ckpt_dir / 'history.json'} names checkpoint "
                                    f"{state['checkpoint']!r}, which is not in {ckpt_dir}")
        saved = ckpt_dir / state["checkpoint"]
        restore_checkpoint(lambda: checkpoint.read(str(saved)).assert_existing_objects_matched(), saved)
        run.history = [EpochRecord(**h) for h in state["history"]]
        start = state["epoch"]
    diverged = _FirstNonFinite()
    callbacks += [diverged,
                  keras.callbacks.TensorBoard(str(out_dir / "tensorboard"), write_graph=False),  # QAT: no JSON graph
                  _Scalars(manager, out_dir / "tensorboard")]
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    for epoch in range(start, epochs):
        order = epoch_order(len(x_train), seed, epoch)
        history = model.fit(x_train[order], y_train[order], batch_size=BATCH_SIZE, epochs=epoch + 1,
                            initial_epoch=epoch, shuffle=False, callbacks=callbacks,
                            verbose=0)
        test_accuracy = float((model.predict(x_test, verbose=0).argmax(1) == y_test).mean())
        lr = float(keras.ops.convert_to_numpy(optimizer.learning_rate))
        record = EpochRecord(epoch + 1, float(history.history["loss"][-1]), float(history.history["accuracy"][-1]),
                             test_accuracy, _kernel_sparsity(model)[0], lr)
        if diverged.step is not None:
            check_finite("keras", diverged.step, diverged.loss)
        check_finite("keras", (epoch + 1) * steps_per_epoch, record.loss,
                     weights=model.get_weights())
        run.history.append(record)
        prefix = checkpoint.write(str(ckpt_dir / f"{CHECKPOINT}-{epoch + 1}"))  # history.json is the commit point
        write_text_atomically(ckpt_dir / "history.json", json.dumps(
            {"epoch": epoch + 1, "checkpoint": Path(prefix).name, "history": [vars(h) for h in run.history]}))
        if progress:  # after the commit point: a printed epoch is a saved one
            print(epoch_line("keras", record, epochs), flush=True)
    manager.finalize(model)
    overall, layers = _kernel_sparsity(model)
    onnx_path = export_onnx(model, out_dir / "model.onnx")
    quantized = bool(manager.quantized_layers)
    run.artefacts = [Artefact(("QAT ONNX export (QDQ)" if quantized else "ONNX export (fp32)") + " of the Keras model",
                              "keras", onnx_path, sparsity=overall, layer_sparsity=layers, qat=quantized)]
    return run
