"""What a QAT model holds: its QAT modules and fake-quantizers, what each layer quantizes in one line, and the
tensors QAT added to its state dict."""

from __future__ import annotations

import torch
from torch import nn

from .quantizers import W_LEVELS, ActivationFakeQuantize, GroupWeightFakeQuantize, WeightFakeQuantize

from .layers import QATEmbedding, QATModule
from .weight_only import WeightOnlyEmbedding, WeightOnlyLinear


def describe(module: QATModule | WeightOnlyLinear) -> str:
    """What a QAT layer quantizes, e.g. ``Linear, weight (64, 64) int8 per channel, input uint8, output float``."""
    if isinstance(module, WeightOnlyEmbedding):
        return f"Embedding, table {tuple(module.weight.shape)} {module.weight_fake_quant.describe()}, rows float"
    if isinstance(module, WeightOnlyLinear):
        return (f"Linear, weight {(module.out_features, module.in_features)} "
                f"{module.weight_fake_quant.describe()}, weight-only (input and output float)")
    if isinstance(module, QATEmbedding):
        return f"Embedding, table {tuple(module.weight.shape)} int8 per row, rows float"
    fq_in, fq_out = module.input_fake_quant, module.activation_post_process
    source = "uint8" if fq_in is not None and fq_in.active else "from a quantized layer"
    if fq_in is not None and fq_in.active and fq_in.learned:
        source += " (learned scale)"
    output = "uint8" if fq_out is not None and fq_out.active else "float"
    bits = "int8" if module.weight_fake_quant.levels == W_LEVELS else "7-bit int8 (reduce_range)"
    learned = " (learned scales)" if module.weight_fake_quant.learned else ""
    return (f"{module.extra_repr().split(',')[0]}, weight {tuple(module.weight.shape)} {bits} per channel{learned}, "
            f"input {source}, output {output}")


def qat_modules(model: nn.Module) -> list[QATModule]:
    return [m for m in model.modules() if isinstance(m, QATModule)]


def fake_quantizers(model: nn.Module) -> list[nn.Module]:
    """Every activation and weight fake-quantizer in ``model`` (to freeze their observers)."""
    return [m for m in model.modules()
            if isinstance(m, (ActivationFakeQuantize, WeightFakeQuantize, GroupWeightFakeQuantize))]


def quantizer_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """What QAT added to ``model.state_dict()``, by name: its quantizers' scales, zero points and observed ranges
    (the layers' own weights keep the float model's names)."""
    kinds = (ActivationFakeQuantize, WeightFakeQuantize, GroupWeightFakeQuantize)
    return {f"{name}.{key}": tensor for name, m in model.named_modules() if isinstance(m, kinds)
            for key, tensor in m.state_dict().items()}
