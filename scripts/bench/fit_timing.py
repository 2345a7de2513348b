"""Per-step times of Keras ``fit``: the variants take one epoch each per round, in a rotating order.

Takes the ``keras`` module as an argument, so the same routine times Keras 3 here and tf-keras in the TensorFlow
Model Optimization peer's own environment (``bench/peer_tfmot.py``), which has nothing of recal.
"""

from __future__ import annotations

import time


def fit_step_times(keras, built: dict, x, y, rounds: int, batch_size: int = 128) -> dict[str, list[float]]:
    """Seconds of each training step of each ``(model, callbacks)`` in ``built``, after one untimed epoch each;
    the first step of every epoch (input pipeline start, host sync) is left out."""

    class StepTimes(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.times, self._last = [], 0.0

        def on_train_batch_begin(self, batch, logs=None):
            self._last = time.perf_counter()

        def on_train_batch_end(self, batch, logs=None):
            self.times.append(time.perf_counter() - self._last)

    for model, callbacks in built.values():  # trace and warm up
        model.fit(x, y, batch_size=batch_size, epochs=1, callbacks=callbacks, verbose=0)
    times: dict[str, list[float]] = {name: [] for name in built}
    order = list(built)
    for r in range(rounds):
        for name in order[r % len(order):] + order[:r % len(order)]:
            model, callbacks = built[name]
            timer = StepTimes()
            model.fit(x, y, batch_size=batch_size, epochs=r + 2, initial_epoch=r + 1, callbacks=callbacks + [timer],
                      verbose=0)
            times[name] += timer.times[1:]
    return times
