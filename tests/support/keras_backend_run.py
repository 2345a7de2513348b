"""Two recipes on the digits net with ``recal_keras`` on whichever Keras backend this process runs, for
:mod:`tests.keras.test_keras_backends`: pruning, LR and weight decay (what every step left: LR, decay, each pruned kernel's
zeros), and prune + QAT (when QAT started and BatchNorm froze, the Keras QAT model's predictions, its int8 ONNX
model's and a reloaded ``.keras`` file's), each written to an ``.npz``.

``KERAS_BACKEND=jax python -m tests.support.keras_backend_run OUT.npz [MODEL.onnx [QAT.npz]]`` (the blocks' run:
``QAT_blocks.npz``); the test runs TensorFlow's in its own process (its blocks: :mod:`tests.keras.test_keras_qat_blocks`).
The initial weights come from NumPy (each backend's random initializers differ), so every backend starts alike.
"""

from __future__ import annotations

import sys

import numpy as np

RECIPE = """
modifiers:
  - !EpochRangeModifier {start_epoch: 0.0, end_epoch: 4.0}
  - !LearningRateModifier {start_epoch: 0.0, end_epoch: 4.0, lr_class: ExponentialLR, lr_kwargs: {gamma: 0.7},
                           init_lr: 0.05}
  - !SetWeightDecayModifier {weight_decay: 0.002, start_epoch: 1.0}
  - !GMPruningModifier {start_epoch: 0.0, end_epoch: 3.0, update_frequency: 0.5, init_sparsity: 0.05,
                        final_sparsity: 0.8, params: [conv0/kernel, conv1/kernel]}
  - !GMPruningModifier {start_epoch: 0.5, end_epoch: 2.0, update_frequency: 0.5, init_sparsity: 0.1,
                        final_sparsity: 0.5, params: [conv2/kernel], mask_type: "2:4"}
  - !GMPruningModifier {start_epoch: 0.0, end_epoch: 2.0, update_frequency: 1.0, init_sparsity: 0.2,
                        final_sparsity: 0.6, params: [fc/kernel], mask_type: block4, leave_enabled: false}
"""
STEPS_PER_EPOCH, BATCH = 4, 32
PRUNED = ("conv0/kernel", "conv1/kernel", "conv2/kernel", "fc/kernel")


QAT_RECIPE = """
modifiers:
  - !EpochRangeModifier {start_epoch: 0.0, end_epoch: 3.0}
  - !GMPruningModifier {params: __ALL_PRUNABLE__, init_sparsity: 0.3, final_sparsity: 0.6, start_epoch: 0.0,
                        end_epoch: 1.0, update_frequency: 0.5}
  - !QuantizationModifier {start_epoch: 1.0, freeze_bn_stats_epoch: 2.5}
  - !SetLearningRateModifier {learning_rate: 0.01, start_epoch: 1.0}
"""
QAT_STEPS_PER_EPOCH = 12


def _digits_net():
    """The digits net with the same NumPy-drawn kernels on every backend."""
    from recal_app.keras_digits import digits_model

    model = digits_model(0)
    rng = np.random.default_rng(0)
    for variable in model.weights:
        if variable.path.endswith("kernel"):
            limit = np.sqrt(6.0 / (np.prod(variable.shape[:-1]) + variable.shape[-1]))
            variable.assign(rng.uniform(-limit, limit, variable.shape).astype(np.float32))
    return model


def run(out: str, onnx_path: str | None = None, resume: bool = True) -> None:
    import keras

    from recal_core.datasets import load_digits
    from recal_keras import ScheduledModifierManager, export_onnx
    from recal_keras.params import describe_model

    imported_tensorflow = "tensorflow" in sys.modules  # recal's own imports (keras.utils.set_random_seed seeds TF too)

    model = _digits_net()
    optimizer = keras.optimizers.SGD(0.1, momentum=0.9)
    manager = ScheduledModifierManager.from_yaml(RECIPE)
    model, callbacks = manager.modify(model, optimizer, steps_per_epoch=STEPS_PER_EPOCH)
    model.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    _, by_name = describe_model(model)
    rows = {"lr": [], "weight_decay": [], "step": [], **{name: [] for name in PRUNED}}

    class Record(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            getattr(self.model, "jax_state_sync", lambda: None)()  # JAX keeps the state off the variables in fit
            rows["lr"].append(float(optimizer.learning_rate.numpy()))
            rows["weight_decay"].append(float(optimizer.weight_decay))

        def on_train_batch_end(self, batch, logs=None):
            getattr(self.model, "jax_state_sync", lambda: None)()
            rows["step"].append(int(optimizer.iterations.numpy()))
            for name in PRUNED:
                rows[name].append(np.packbits(np.asarray(by_name[name].numpy()) == 0))

    class SaveAtEpoch2(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            if epoch == 1 and checkpoint:
                self.model.save(checkpoint)

    digits = load_digits()
    n = STEPS_PER_EPOCH * BATCH
    x, y = digits.train_images[:n, ..., None], digits.train_labels[:n]
    checkpoint = resume and onnx_path and str(onnx_path).replace(".onnx", ".keras")
    model.fit(x, y, batch_size=BATCH, epochs=4, callbacks=callbacks + [Record(), SaveAtEpoch2()], verbose=0,
              shuffle=False)
    if checkpoint:  # a new process's resume: the .keras file of epoch 2, a new manager, epochs 3 and 4
        resumed = keras.models.load_model(checkpoint)
        resumed, resumed_callbacks = ScheduledModifierManager.from_yaml(RECIPE).modify(
            resumed, resumed.optimizer, steps_per_epoch=STEPS_PER_EPOCH)
        resumed.compile(optimizer=resumed.optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        resumed.fit(x, y, batch_size=BATCH, epochs=4, initial_epoch=2, callbacks=resumed_callbacks, verbose=0,
                    shuffle=False)
        rows["resume_error"] = max(np.abs(np.asarray(a.numpy()) - np.asarray(b.numpy())).max()
                                   for a, b in zip(model.weights, resumed.weights))
    final = manager.finalize(model)
    if onnx_path:  # the pruned model exported with this backend's exporter, run by onnxruntime
        import onnxruntime

        images = digits.test_images[:64, ..., None]
        session = onnxruntime.InferenceSession(export_onnx(model, onnx_path))
        exported = session.run(None, {session.get_inputs()[0].name: images})[0]
        rows["onnx_error"] = np.abs(exported - np.asarray(model.predict(images, verbose=0))).max()
        rows["onnx_zeros"] = _zeros_in(onnx_path)
    rows["final"] = np.array([final[name] for name in PRUNED])
    rows["fc"] = np.asarray(by_name["fc/kernel"].numpy())
    rows["bn0"] = np.asarray(by_name["bn0/gamma"].numpy())
    rows["tensorflow_imported"] = imported_tensorflow
    np.savez(out, backend=keras.backend.backend(), **{k: np.asarray(v) for k, v in rows.items()})


def run_qat(out: str) -> None:
    """Prune and QAT, finalize, export with this backend's exporter, convert to int8, save and reload a ``.keras``."""
    import onnx
    import onnxruntime

    import keras

    from recal_core.datasets import load_digits
    from recal_onnx import quantize_qat_export
    from recal_keras import ScheduledModifierManager, export_onnx

    model, optimizer = _digits_net(), keras.optimizers.SGD(0.05, momentum=0.9)
    manager = ScheduledModifierManager.from_yaml(QAT_RECIPE)
    qat, callbacks = manager.modify(model, optimizer, steps_per_epoch=QAT_STEPS_PER_EPOCH)
    qat.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    first = qat.get_layer("conv0_qat")
    rows = {"observed": [], "bn0_mean": []}

    class Record(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            getattr(self.model, "jax_state_sync", lambda: None)()
            rows["observed"].append(float(first.output_quantizer.observed.numpy()))
            rows["bn0_mean"].append(np.asarray(first.bn.moving_mean.numpy()).copy())

    digits = load_digits()
    n = QAT_STEPS_PER_EPOCH * BATCH
    qat.fit(digits.train_images[:n, ..., None], digits.train_labels[:n], batch_size=BATCH, epochs=3,
            callbacks=callbacks + [Record()], verbose=0, shuffle=False)
    manager.finalize(qat)
    images = digits.test_images[..., None]
    rows["keras"] = np.asarray(qat.predict(images, verbose=0))
    path = export_onnx(qat, out.replace(".npz", "_qat.onnx"))
    result = quantize_qat_export(path, out.replace(".npz", "_int8.onnx"))
    session = onnxruntime.InferenceSession(str(result.path))
    rows["int8"] = session.run(None, {session.get_inputs()[0].name: images})[0]
    rows["int8_ops"] = sorted({node.op_type for node in onnx.load(str(result.path)).graph.node})
    rows["output_step"] = result.verification.output_step
    qat.save(out.replace(".npz", "_qat.keras"))
    rows["reloaded"] = np.asarray(keras.models.load_model(out.replace(".npz", "_qat.keras")).predict(images, verbose=0))
    rows["labels"] = digits.test_labels
    np.savez(out, backend=keras.backend.backend(), **{k: np.asarray(v) for k, v in rows.items()})


def run_blocks(out: str) -> None:
    """keras.applications' pieces (:data:`tests.support.keras_blocks.BLOCKS`, and ResNet's stem and residual block) under
    prune + QAT, exported by this backend's exporter and converted: each one's op types, the float ops the
    converter left between integer ones, the Keras QAT model's outputs and the int8 model's as written, in a default
    onnxruntime session and with optimizations off."""
    import tempfile

    import keras
    import onnxruntime

    from tests.support.keras_blocks import BLOCKS, block_to_int8, residual_net
    from tests.support.onnx_graphs import run as run_onnx

    rows = {}
    levels = (onnxruntime.GraphOptimizationLevel.ORT_ENABLE_ALL, onnxruntime.GraphOptimizationLevel.ORT_DISABLE_ALL)
    for name, build in {**BLOCKS, "residual": residual_net}.items():
        with tempfile.TemporaryDirectory() as folder:
            manager, feeds, expected, result, ops = block_to_int8(build(), folder)
        rows[f"{name}_quantized"] = sorted(manager.quantized_layers)
        rows[f"{name}_ops"] = ops
        rows[f"{name}_tables"] = result.rewrites.get("unary_to_table", 0)
        rows[f"{name}_unconverted"] = [f"{op} {node}" for op, node in result.unconverted] or [""]
        rows[f"{name}_keras"] = expected
        rows[f"{name}_int8"] = np.stack([run_onnx(result.model, feeds, level=level, as_written=True)[0]
                                         for level in levels])
    np.savez(out, backend=keras.backend.backend(), **{k: np.asarray(v) for k, v in rows.items()})


def run_large_export(out: str) -> None:
    """A model whose weights (1 MiB) the exporter writes beside the model file (jax2onnx does): what the export
    folder holds afterwards, and how far the file's outputs are from the model's."""
    import os
    import tempfile

    import keras
    import onnxruntime

    from recal_keras import export_onnx

    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(4096), keras.layers.Dense(10)])
    x = np.random.default_rng(0).standard_normal((3, 64)).astype(np.float32)
    expected = np.asarray(model.predict(x, verbose=0))
    with tempfile.TemporaryDirectory() as folder:
        path = export_onnx(model, os.path.join(folder, "large.onnx"))
        files = sorted(os.listdir(folder))
        session = onnxruntime.InferenceSession(path)
        error = float(np.abs(session.run(None, {session.get_inputs()[0].name: x})[0] - expected).max())
    np.savez(out, files=np.array(files), error=error)


def _zeros_in(path: str) -> int:
    """Zeros in the exported model's weights of four or more dimensions or matrices (its conv and dense kernels)."""
    import onnx
    from onnx import numpy_helper

    weights = [numpy_helper.to_array(t) for t in onnx.load(path).graph.initializer]
    return int(sum((w == 0).sum() for w in weights if w.ndim >= 2))


if __name__ == "__main__":
    run(*sys.argv[1:3])
    if len(sys.argv) > 3:
        run_qat(sys.argv[3])
        run_blocks(sys.argv[3].replace(".npz", "_blocks.npz"))
        run_large_export(sys.argv[3].replace(".npz", "_large.npz"))
