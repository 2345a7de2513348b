"""When QAT is on, BatchNorm frozen and observers frozen, per step: the QuantizationModifier's schedule as tables
that a train step reads at its step counter (no framework here: :meth:`QATTables.at` reads them with the
framework's ops adapter, :mod:`recal_keras.tensor_ops`)."""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np

from recal_core.modifiers import WEIGHT_LEVELS
from recal_core.recipe import Recipe
from recal_core.schedule import RecipeSchedule

AVERAGING_CONSTANT = 0.01  # the observers' moving-average weight, as torch.ao's MovingAverageMinMaxObserver


@dataclass
class QATTables:
    """The QuantizationModifier's switches per step, read at the step ``iterations`` (Keras: the optimizer's
    ``iterations``; the graph API: the global step)."""

    enabled: np.ndarray
    bn_frozen: np.ndarray
    observers_frozen: np.ndarray
    iterations: object = None
    export: bool = False  # inference graph for export: always quantized, no switches
    weight_levels: int = WEIGHT_LEVELS  # 64 with the modifier's reduce_range
    ops: object = None  # the tensor ops adapter that reads them (TensorFlow's when None)
    # JAX: the model's own step variable (see recal_keras.quantized_layer.QuantizedLayer.count_steps)
    counter: object = None
    current: object = None  # JAX: the step this forward pass reads, set by the counter's layer as it runs first

    @classmethod
    def from_schedule(cls, schedule: RecipeSchedule, index: int, iterations, ops=None) -> "QATTables":
        """The tables of the recipe's QuantizationModifier at ``index``, read at ``iterations`` (a step tensor)."""
        steps = schedule.total_steps + 1
        flags = np.fromiter(((s.enabled, s.bn_frozen, s.observers_frozen) for s in
                             (schedule.qat(index, k) for k in range(steps))), dtype=np.dtype((bool, 3)), count=steps)
        return cls(flags[:, 0].copy(), flags[:, 1].copy(), flags[:, 2].copy(), iterations,
                   weight_levels=schedule.recipe.modifiers[index].weight_levels, ops=ops)

    @classmethod
    def fixed(cls, enabled: bool, export: bool, weight_levels: int = WEIGHT_LEVELS, ops=None) -> "QATTables":
        """Tables that say the same at every step, with BatchNorm and observers frozen: a QAT layer loaded from a
        ``.keras`` file, as it computed when saved, until a recipe's manager takes it on again."""
        return cls(np.array([enabled]), np.array([True]), np.array([True]), 0, export, weight_levels, ops)

    @property
    def observing(self) -> np.ndarray:
        """Steps at which the observers update their ranges: QAT on and observers not yet frozen."""
        return self.enabled & ~self.observers_frozen

    def at(self, table: np.ndarray, step=None):
        """``table`` at ``step`` (default: ``iterations``), clipped to its last entry: a boolean tensor, or a Python
        bool where the framework runs op by op (PyTorch)."""
        if self.ops is None:
            from .tensor_ops import TensorFlowOps

            self.ops = TensorFlowOps()
        o, last = self.ops, len(table) - 1
        if step is None and self.counter is not None:
            step = self.current
        step = self.iterations if step is None else step
        step = getattr(step, "value", step)  # a Keras variable: its value in this step (a JAX trace's own)
        if isinstance(step, int):
            return bool(table[min(step, last)])
        if getattr(o, "eager", False):
            return bool(table[min(int(o.ops.convert_to_numpy(step)), last)])
        return o.take(o.constant(table), o.minimum(o.cast(step, o.index_dtype), last))


def quantize_at_completion(recipe: Recipe, index: int, unobserved: list[str], observers: int, step: int,
                           category: type[Warning], stacklevel: int) -> bool:
    """Whether a QAT model completed at ``step`` exports quantized: yes when every range was observed; no, with a
    warning, when none was (QAT never ran: its ranges are empty); a model with some ranges never observed is an
    error naming them. ``stacklevel`` points the warning at the user's call."""
    where = recipe.describe(index)
    if unobserved and len(unobserved) < observers:
        raise RuntimeError(f"{where}: these activations were never observed, so they have no range to quantize "
                           f"with: {', '.join(unobserved)} (a branch no training step ran?); train until every "
                           "quantized tensor has been seen, or remove the modifier")
    if unobserved:
        warnings.warn(f"{where}: QAT had not run by step {step}, so the model is completed float", category,
                      stacklevel=stacklevel + 1)
    return not unobserved
