"""Quantization-aware training without ``torch.ao``: the QAT subsystem, and its names for users and for recal's
other packages.

- :mod:`~recal_torch.qat.quantizers`: the uint8 / int8 grids, their observers and learned scales (the math);
- :mod:`~recal_torch.qat.layers`: the QAT layers built around a float layer's own Parameters;
  :mod:`~recal_torch.qat.weight_only`: the weight-only ones; :mod:`~recal_torch.qat.inventory`: what a QAT model holds;
- :mod:`~recal_torch.qat.trace` and :mod:`~recal_torch.qat.patterns`: one real forward as a graph, and what the
  planner recognises in it;
- :mod:`~recal_torch.qat.plan`: which layers become QAT layers, what they fuse, which tensors are quantized (the
  fusions read off the traced forward: :mod:`~recal_torch.qat.fusion_plan`);
- :mod:`~recal_torch.qat.sites` and :mod:`~recal_torch.qat.attention`: quantizers on single calls (residual adds,
  products, SiLUs) and on the attention matmuls;
- :mod:`~recal_torch.qat.log_scales`: learned scales stepped in log space under Adam and its kin, watched under SGD;
- :mod:`~recal_torch.qat.control`: the recipe's QuantizationModifiers switched on and frozen at their steps.

The model is changed in place by :func:`fake_quantize_model`; the recipe's QuantizationModifier calls it at its
start. The rest of recal_torch imports from here, never from a module of this package.

An internal room: it declares no ``__all__``; what a user imports is :mod:`recal_torch`'s.
"""

from .attention import SLOTS, AttentionFakeQuantize, quantize_attention
from .control import QATControl, input_groups, layer_schemes, qat_roots
from .inventory import describe, fake_quantizers, qat_modules, quantizer_tensors
from .layers import (CONVS, FoldedBatchNorm, QATConv, QATConv1d, QATConv2d, QATConv3d, QATEmbedding, QATLinear,
                     QATModule, QATTorchLinear, QuantizedReLU, clamp, is_table, is_transposed_linear_type)
from .log_scales import LogScaleSteps, steps_in_log_space
from ..errors import QATPlanWarning
from .plan import fake_quantize_model, plan_pending, quantizable_layers
from .quantizers import (ACT_QMAX, ACT_QMIN, EPS, REDUCED_W_LEVELS, W_LEVELS, W_QMAX, W_QMIN, ActivationFakeQuantize,
                         GroupWeightFakeQuantize, SiLUFakeQuantize, WeightFakeQuantize, activation_qparams,
                         weight_qparams)
from .sites import CONTAINER, adopt
from .weight_only import WeightOnlyEmbedding, WeightOnlyLinear, WeightOnlyTorchLinear
