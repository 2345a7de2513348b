"""recal_torch: apply a recal recipe to a PyTorch training loop; QAT; ONNX export.

>>> from recal_torch import ScheduledModifierManager
>>> manager = ScheduledModifierManager.from_yaml("scripts/recipes/seed_prune_all.yaml")  # doctest: +SKIP
>>> optimizer = manager.modify(model, optimizer, steps_per_epoch=len(loader))            # doctest: +SKIP
"""

from recal_core.loggers import PythonLogger, RecalLogger

from .export import export_onnx, to_export_model
from .loggers import TensorBoardLogger
from .manager import ScheduledModifierManager
from .optimizer import RecalOptimizer
from .qat import QATConv, QATLinear, QATModule, prepare_qat

__all__ = [
    "PythonLogger", "QATConv", "QATLinear", "QATModule", "RecalLogger", "RecalOptimizer",
    "ScheduledModifierManager", "TensorBoardLogger", "export_onnx", "prepare_qat", "to_export_model",
]
