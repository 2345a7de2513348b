"""recal_torch: apply a recal recipe to a PyTorch training loop; QAT; ONNX export.

>>> from recal_torch import ScheduledModifierManager
>>> manager = ScheduledModifierManager.from_yaml("recal:seed_prune_all")  # doctest: +SKIP
>>> optimizer = manager.modify(model, optimizer, steps_per_epoch=len(loader))            # doctest: +SKIP
"""

from recal_core.loggers import PythonLogger, RecalLogger

from .export import ExportError, ExportWarning, export_onnx, to_export_model
from .flops import count_macs
from .loggers import TensorBoardLogger
from .manager import ScheduledModifierManager
from .precision_plan import PrecisionPlan, measure_precision, plan_precision
from .qat import QATConv, QATLinear, QATModule, fake_quantize_model
from .errors import QATPlanWarning, ThinningError
from .load_thinned import load_thinned
from .thin import ThinningWarning, ThinReport, thin

__all__ = [
    "ExportError", "ExportWarning", "PrecisionPlan", "PythonLogger", "QATConv", "QATLinear", "QATModule",
    "QATPlanWarning",
    "RecalLogger", "ScheduledModifierManager",
    "TensorBoardLogger", "ThinReport", "ThinningError", "ThinningWarning", "count_macs", "export_onnx",
    "fake_quantize_model", "load_thinned", "measure_precision", "plan_precision", "thin", "to_export_model",
]
