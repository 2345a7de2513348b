"""Quantization-aware training without ``torch.ao``: the public names, gathered from three modules.

- :mod:`recal_torch.fake_quant`: the uint8 / int8 grids and their observers (the math);
- :mod:`recal_torch.qat_modules`: the QAT layers built around a float layer's own Parameters;
- :mod:`recal_torch.qat_plan`: which layers become QAT layers, what they fuse, which tensors are quantized.

The model is changed in place by :func:`fake_quantize_model`; the recipe's QuantizationModifier calls it at its
start. Nothing inside recal imports this module (it imports them), so the three never form a cycle.
"""

from .fake_quant import (ACT_QMAX, ACT_QMIN, REDUCED_W_LEVELS, W_LEVELS, W_QMAX, W_QMIN, ActivationFakeQuantize,
                         GroupWeightFakeQuantize, SiLUFakeQuantize, WeightFakeQuantize, activation_qparams,
                         weight_qparams)
from .qat_modules import (CONVS, FoldedBatchNorm, QATConv, QATEmbedding, QATLinear, QATModule, QuantizedReLU,
                          WeightOnlyEmbedding, WeightOnlyLinear, describe, fake_quantizers, is_table, qat_modules)
from .qat_plan import fake_quantize_model, plan_pending, quantizable_layers

__all__ = ["ACT_QMAX", "ACT_QMIN", "REDUCED_W_LEVELS", "W_LEVELS", "W_QMAX", "W_QMIN", "ActivationFakeQuantize",
           "SiLUFakeQuantize", "WeightFakeQuantize", "GroupWeightFakeQuantize", "WeightOnlyLinear",
           "WeightOnlyEmbedding", "activation_qparams", "weight_qparams", "CONVS",
           "FoldedBatchNorm", "QATConv", "QATEmbedding", "QATLinear", "QATModule", "QuantizedReLU", "describe",
           "fake_quantizers", "is_table", "qat_modules", "fake_quantize_model", "plan_pending", "quantizable_layers"]
