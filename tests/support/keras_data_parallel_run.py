"""A recipe (pruning and LR) on a Keras model under JAX data parallelism, and the same run on one device, for
:mod:`tests.keras.test_keras_backends`: ``KERAS_BACKEND=jax python -m tests.support.keras_data_parallel_run OUT.npz``. The
process gets two CPU devices (``XLA_FLAGS``); ``keras.distribution.DataParallel`` splits each batch over them."""

from __future__ import annotations

import os
import sys

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"

import numpy as np

RECIPE = """
- !EpochRangeModifier {start_epoch: 0, end_epoch: 3}
- !GMPruningModifier {params: __ALL_PRUNABLE__, init_sparsity: 0.1, final_sparsity: 0.7, start_epoch: 0, end_epoch: 2,
                      update_frequency: 0.5}
- !LearningRateModifier {start_epoch: 0, end_epoch: 3, lr_class: ExponentialLR, lr_kwargs: {gamma: 0.5}, init_lr: 0.05}
"""


def run(parallel: bool) -> dict[str, np.ndarray]:
    import jax
    import keras

    from recal_keras import ScheduledModifierManager

    if parallel:
        keras.distribution.set_distribution(keras.distribution.DataParallel(devices=jax.devices()))
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((8, 8, 1)), keras.layers.Conv2D(8, 3, name="conv"), keras.layers.ReLU(),
                              keras.layers.Flatten(), keras.layers.Dense(10, name="fc")])
    optimizer = keras.optimizers.SGD(0.1)
    model, callbacks = ScheduledModifierManager.from_yaml(RECIPE).modify(model, optimizer, steps_per_epoch=4)
    model.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    rng = np.random.default_rng(0)
    x, y = rng.random((128, 8, 8, 1), dtype=np.float32), rng.integers(0, 10, 128)
    model.fit(x, y, batch_size=32, epochs=3, callbacks=callbacks, verbose=0, shuffle=False)
    kernel = model.get_layer("conv").kernel.value
    return {"devices": np.array(len(getattr(kernel, "sharding").device_set)), "lr": np.array(float(optimizer.learning_rate)),
            **{w.path.split("/", 1)[1]: np.asarray(w) for w in model.weights}}  # conv/kernel, not sequential_1/...


if __name__ == "__main__":
    single, parallel = run(False), run(True)
    np.savez(sys.argv[1], **{f"single/{k}": v for k, v in single.items()},
             **{f"parallel/{k}": v for k, v in parallel.items()})
