"""What every backend's ``ScheduledModifierManager`` shares: holding a validated recipe."""

from __future__ import annotations

import os

from .recipe import Recipe, load_recipe


class RecipeManager:
    """Base of the backends' managers: the recipe, ``from_yaml`` and the recipe's epoch range."""

    def __init__(self, recipe: Recipe):
        if not isinstance(recipe, Recipe):
            raise TypeError(f"{type(self).__name__} takes a Recipe, not {type(recipe).__name__}; "
                            f"use {type(self).__name__}.from_yaml(path_or_text)")
        self.recipe = recipe

    @classmethod
    def from_yaml(cls, source: str | os.PathLike | Recipe):
        """Load a recipe (path, YAML string or Markdown with front matter) into a new manager."""
        return cls(load_recipe(source))

    @property
    def max_epochs(self) -> int:
        """Epochs to train: the last epoch any modifier mentions, rounded up (for ``range``)."""
        return self.recipe.max_epochs

    @property
    def min_epochs(self) -> int:
        return self.recipe.min_epochs
