"""recal_keras's warnings (its errors are the core's: a recipe Keras cannot run is a ``RecipeError`` located in the
recipe). The TensorFlow graph front end says its warnings with the same class."""

from __future__ import annotations

from recal_core.errors import RecipeWarning


class RecalWarning(RecipeWarning):
    """A recipe feature is set up in a way that will not have its effect: the Keras and TensorFlow front ends'
    :class:`~recal_core.errors.RecipeWarning` (``RecipeWarning`` catches it in every framework)."""
