"""How a pruning step runs inside Keras's own update: a constraint on the variable that drives the masks, which
Keras calls after each optimizer update, wrapping the user's constraint."""

from __future__ import annotations

import keras


class ApplyMasks(keras.constraints.Constraint):
    """The constraint Keras calls after each update: recal's mask step, then the user's own constraint."""

    def __init__(self, manager, inner):
        self.manager = manager
        self.inner = inner
        self._step = manager._step
        if manager._tf:  # plain graph code: autograph's rewrite costs seconds, changes nothing
            import tensorflow as tf

            self._step = tf.autograph.experimental.do_not_convert(self._step)

    def __call__(self, w):
        value = self._step(self.manager._optimizer.iterations + 1)
        return self.inner(value) if self.inner is not None else value
