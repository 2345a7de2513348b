"""The Keras callback ``modify`` returns: what is set per epoch or at the start of ``fit`` (the masks in force, the
trainable flags), and the checks that the model, its optimizer and its epochs are the ones the recipe was bound to."""

from __future__ import annotations

import warnings
import keras

from .errors import RecalWarning


class RecalCallback(keras.callbacks.Callback):
    """Applies what is set per epoch or at start: masks in force on (re)start, trainable flags; checks that
    an epoch has the steps the recipe was bound with."""

    def __init__(self, manager):
        super().__init__()
        self.manager = manager
        self._epoch_start = 0

    def on_train_begin(self, logs=None):
        m = self.manager
        if m._finalized:
            raise RuntimeError("finalize() was called: the recipe is done; create a new manager to train again")
        if self.model is not m._model:
            raise ValueError("these callbacks belong to another model: pass the callbacks that modify() returned "
                             "for this model")
        compiled = getattr(self.model, "optimizer", None)  # None: a custom loop's model
        # mixed precision: Keras wraps the optimizer in a LossScaleOptimizer at compile; recal drives the inner one
        if getattr(compiled, "inner_optimizer", compiled) not in (None, m._optimizer):
            raise ValueError("the model was compiled with another optimizer than the one passed to modify(): "
                             "compile with the same optimizer object (or a LossScaleOptimizer around it)")
        m._check_pruned_in_model()  # the state of the step is applied at on_epoch_begin, after every on_train_begin

    def on_epoch_begin(self, epoch, logs=None):
        m = self.manager
        m._check_pruned_in_model()
        m._apply_now()  # after every on_train_begin: BackupAndRestore may have restored another step's weights
        self._epoch_start = m._current_step()
        if m._apply_trainable(self.model):
            self.model.make_train_function(force=True)

    def on_epoch_end(self, epoch, logs=None):
        m = self.manager
        ran = m._current_step() - self._epoch_start
        expected = m.schedule.steps_per_epoch
        if ran != expected and not self.model.stop_training:  # a callback that stops fit cuts the epoch short
            warnings.warn(f"epoch {epoch} ran {ran} steps, but the recipe was bound with steps_per_epoch={expected}: "
                          f"the recipe's epochs are {expected} steps each, not this fit's epochs", RecalWarning,
                          stacklevel=1)  # called by Keras: the user's line is not on the stack
