"""A recipe (pruning, LR, QAT) on a Keras model under TensorFlow's ``MultiWorkerMirroredStrategy``, for
:mod:`tests.keras.test_keras_training`: ``python -m tests.support.keras_multiworker_run INDEX PORTS OUT`` on each worker (``PORTS``: the
workers' ports, comma-separated; one port: the same run in one process, no strategy). Keras 3's ``fit`` fails
under this strategy whatever the model (it cannot convert the distributed batch: a Keras issue, recal or not),
so the run is the custom training loop TensorFlow's multi-worker guide writes, ``strategy.run`` of a step that
applies the gradients, with recal's callbacks called through a ``CallbackList``: recal's work happens in the
optimizer's update, as in ``fit``. Each worker saves its weights to ``OUT/w<index>_<workers>.npz``."""

from __future__ import annotations

import json
import os
import sys

RECIPE = """
- !EpochRangeModifier {start_epoch: 0, end_epoch: 3}
- !GMPruningModifier {params: [d1], init_sparsity: 0.2, final_sparsity: 0.6, start_epoch: 0, end_epoch: 2,
                      update_frequency: 0.5}
- !LearningRateModifier {start_epoch: 0, end_epoch: 3, lr_class: ExponentialLR, lr_kwargs: {gamma: 0.5}, init_lr: 0.1}
- !QuantizationModifier {start_epoch: 1}
"""
GLOBAL_BATCH, STEPS_PER_EPOCH, EPOCHS = 32, 4, 3


def main(index: int, ports: list[str], out: str) -> None:
    workers = len(ports)
    if workers > 1:
        os.environ["TF_CONFIG"] = json.dumps({"cluster": {"worker": [f"localhost:{p}" for p in ports]},
                                              "task": {"type": "worker", "index": index}})
    import keras
    import numpy as np
    import tensorflow as tf

    from recal_keras import ScheduledModifierManager

    strategy = tf.distribute.MultiWorkerMirroredStrategy() if workers > 1 else tf.distribute.get_strategy()
    with strategy.scope():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(32, activation="relu", name="d1"),
                                  keras.layers.Dense(4, name="d2")])
        optimizer = keras.optimizers.SGD(0.1, momentum=0.9)
        model, callbacks = ScheduledModifierManager.from_yaml(RECIPE).modify(model, optimizer, STEPS_PER_EPOCH)
        loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")
    rng = np.random.RandomState(0)
    x = rng.randn(GLOBAL_BATCH * STEPS_PER_EPOCH, 8).astype("float32")
    y = rng.randint(0, 4, GLOBAL_BATCH * STEPS_PER_EPOCH).astype("int64")
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH)
    if workers > 1:  # each worker its half of every batch
        options = tf.data.Options()
        options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
        data = strategy.experimental_distribute_dataset(data.with_options(options))

    @tf.function
    def step(xb, yb):
        with tf.GradientTape() as tape:
            loss = tf.nn.compute_average_loss(loss_fn(yb, model(xb, training=True)), global_batch_size=GLOBAL_BATCH)
        optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))

    hooks = keras.callbacks.CallbackList(callbacks, model=model)
    hooks.on_train_begin()
    for epoch in range(EPOCHS):
        hooks.on_epoch_begin(epoch)
        for batch, (xb, yb) in enumerate(data):
            hooks.on_train_batch_begin(batch)
            strategy.run(step, args=(xb, yb))
            hooks.on_train_batch_end(batch)
        hooks.on_epoch_end(epoch)
    hooks.on_train_end()
    weights = {w.path: np.asarray(w.numpy()) for w in model.weights}
    np.savez(os.path.join(out, f"w{index}_{workers}.npz"), lr=float(optimizer.learning_rate.numpy()), **weights)


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2].split(","), sys.argv[3])
