"""The bundled digits classifier in Keras, on any Keras backend (``recal train --framework keras`` trains it)."""

from __future__ import annotations

import keras


def digits_model(seed: int) -> keras.Model:
    """Conv-BN-ReLU x2, max-pool, Conv-BN-ReLU, global average pool, dense: the network the torch and graph
    trainers use, for ``[N, 8, 8, 1]`` digits.

    Args:
        seed: Keras's random seed for the initial weights.
    """
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((8, 8, 1), name="inputs")
    x = inputs
    for i, filters in enumerate((32, 32, 64)):
        x = keras.layers.Conv2D(filters, 3, padding="same", use_bias=False, name=f"conv{i}")(x)
        x = keras.layers.BatchNormalization(momentum=0.9, name=f"bn{i}")(x)  # torch's 0.1
        x = keras.layers.ReLU(name=f"relu{i}")(x)
        if i == 1:
            x = keras.layers.MaxPooling2D(2, name="pool")(x)
    x = keras.layers.GlobalAveragePooling2D(name="gap")(x)
    return keras.Model(inputs, keras.layers.Dense(10, name="fc")(x), name="digits_net")
