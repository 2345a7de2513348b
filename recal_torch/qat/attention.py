"""QAT for the attention matmuls (Q·Kᵀ and P·V), which transformer code runs as functions, not modules.

Hugging Face attention calls ``torch.matmul`` (eager) or ``F.scaled_dot_product_attention`` (SDPA) inside its
self-attention module, so no module hook reaches those tensors. While such a module runs forward, a
``TorchFunctionMode`` entered by its forward hooks fake-quantizes the operands of its first two matmuls:
the queries and keys of Q·Kᵀ, the probabilities and values of P·V (uint8, per tensor, one observer each).
An SDPA call is written out as those two matmuls around a softmax, so it is quantized the same way. Export
writes the same tensors as QDQ; the converter turns each matmul into ``MatMulIntegerToFloat``.

The modules are found by their projections: a module whose children include Linears named ``query`` /
``key`` / ``value`` (BERT, ViT), ``q_proj`` / ``k_proj`` / ``v_proj`` (most decoder models) or ``q`` / ``k`` / ``v``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from .quantizers import ActivationFakeQuantize
from .trace import mode_during_forward

SLOTS = ("query", "key", "probs", "value")
PROJECTIONS = (("query", "key", "value"), ("q_proj", "k_proj", "v_proj"), ("q", "k", "v"))
_MATMULS = {torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.bmm}


class AttentionFakeQuantize(nn.Module):
    """The four observers of one attention module: queries, keys, probabilities, values."""

    def __init__(self):
        super().__init__()
        for slot in SLOTS:
            self.add_module(slot, ActivationFakeQuantize())

    def quantize(self, slot: str, x: torch.Tensor) -> torch.Tensor:
        return getattr(self, slot)(x)


def attention_modules(root: nn.Module) -> list[str]:
    """Names of the modules of ``root`` that compute attention from query / key / value projections."""
    names = []
    for name, module in root.named_modules():
        children = dict(module.named_children())
        if any(all(isinstance(children.get(p), nn.Module) for p in group) for group in PROJECTIONS):
            names.append(name)
    return names


def quantize_attention(root: nn.Module, skip: frozenset[str] | set[str] = frozenset()) -> list[str]:
    """Give every attention module of ``root`` (less ``skip``) quantized matmuls; return their names."""
    done = []
    for name in attention_modules(root):
        module = root.get_submodule(name) if name else root
        if name in skip or hasattr(module, "attention_fake_quant"):
            continue
        device = next((p.device for p in module.parameters()), torch.device("cpu"))
        module.attention_fake_quant = AttentionFakeQuantize().to(device)
        mode_during_forward(module, _QuantizedMatmuls)
        done.append(name)
    return done


class _QuantizedMatmuls(TorchFunctionMode):
    """Fake-quantizes the operands of the first two matmuls it sees (Q·Kᵀ, then P·V)."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.quantizers = module.attention_fake_quant
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention and self.calls == 0:
            return self._attention(*args, **kwargs)
        if func in _MATMULS and self.calls < 2 and len(args) == 2 and not kwargs:
            first, second = ("query", "key") if self.calls == 0 else ("probs", "value")
            self.calls += 1
            return func(self.quantizers.quantize(first, args[0]), self.quantizers.quantize(second, args[1]))
        return func(*args, **kwargs)

    def _attention(self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                   enable_gqa=False):
        """SDPA written out: softmax(q·kᵀ · scale + mask) · v, with both matmuls quantized."""
        if enable_gqa and key.shape[-3] != query.shape[-3]:
            repeat = query.shape[-3] // key.shape[-3]
            key, value = key.repeat_interleave(repeat, -3), value.repeat_interleave(repeat, -3)
        scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
        self.calls = 2
        q = self.quantizers.quantize("query", query)
        k = self.quantizers.quantize("key", key)
        scores = torch.matmul(q, k.transpose(-2, -1)) * scale
        if is_causal:
            length, total = query.shape[-2], key.shape[-2]
            causal = torch.ones(length, total, dtype=torch.bool, device=query.device).tril(total - length)
            scores = scores.masked_fill(~causal, float("-inf"))
        if attn_mask is not None:
            scores = scores.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool \
                else scores + attn_mask
        probs = torch.softmax(scores, dim=-1)
        if dropout_p > 0.0:
            probs = F.dropout(probs, dropout_p)
        return torch.matmul(self.quantizers.quantize("probs", probs), self.quantizers.quantize("value", value))
