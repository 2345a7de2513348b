"""Weight-only quantization layers: a ``Linear`` or ``Embedding`` whose weight is on a 2, 4 or 8-bit grid (per row or
in groups), its input and output float, as onnxruntime's ``MatMulNBits`` and ``GatherBlockQuantized`` run them."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..sharding import unsharded_class
from .quantizers import GroupWeightFakeQuantize

from .layers import AdoptsParameters, features, is_transposed_linear_type


class WeightOnlyLinear(AdoptsParameters, nn.Module):
    """A Linear (or transformers' ``Conv1D``) whose weight is fake-quantized and whose input and output stay float
    (W4A16, W8A16): the weight-only layer onnxruntime runs as ``MatMulNBits``. Like a QAT module it adopts the float
    module's Parameters, so the optimizer, masks and checkpoints carry on.

    Args:
        linear: the float layer.
        bits: 2 (ternary), 4 or 8.
        group_size: inputs per scale (``None``: one scale per output channel).
        observer: ``"minmax"`` or ``"mse"`` (:class:`~recal_torch.qat.quantizers.GroupWeightFakeQuantize`).
    """

    def __new__(cls, *args, **kwargs):  # (copy and pickle call it with no arguments, on the subclass)
        if cls is WeightOnlyLinear and isinstance(args[0] if args else kwargs.get("linear"), nn.Linear):
            cls = WeightOnlyTorchLinear
        return super().__new__(cls)

    def __init__(self, linear: nn.Module, bits: int, group_size: int | None, observer: str = "minmax"):
        nn.Module.__init__(self)  # not the layer class's own: the float module's Parameters are kept
        self.float_type = unsharded_class(linear)
        self.adopt_from(linear)
        self.weight = linear.weight
        self.register_parameter("bias", getattr(linear, "bias", None))
        self.transposed = is_transposed_linear_type(unsharded_class(linear))
        self.in_features, self.out_features = features(linear)
        self.weight_fake_quant = GroupWeightFakeQuantize(self.out_features, self.in_features, bits, group_size,
                                                         observer).to(self.weight.device)

    def oriented_weight(self) -> torch.Tensor:
        """The weight as ``[out, in]`` (a Conv1D's transposed)."""
        weight = self.live("weight")
        return weight.t() if self.transposed else weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The linear map of float ``x`` by the fake-quantized weight.

        Args:
            x: the layer's float input."""
        return F.linear(x, self.weight_fake_quant(self.oriented_weight()), self.live("bias"))

    def extra_repr(self) -> str:
        return f"{self.float_type.__name__}, weight {tuple(self.weight.shape)} {self.weight_fake_quant.describe()}"


class WeightOnlyTorchLinear(WeightOnlyLinear, nn.Linear):
    """A :class:`WeightOnlyLinear` made from an ``nn.Linear``, an ``nn.Linear``."""


class WeightOnlyEmbedding(WeightOnlyLinear, nn.Embedding):
    """An embedding table read through symmetric 8- or 4-bit fake quantization per row or per group of a row (each
    row an output channel): onnxruntime gathers its packed integers with ``GatherBlockQuantized``.

    Args:
        embedding: the float table (``nn.Embedding`` without ``max_norm``).
        bits: 4 or 8.
        group_size: columns per scale (``None``: one scale per row).
        observer: ``"minmax"`` or ``"mse"``.
    """

    def __init__(self, embedding: nn.Embedding, bits: int, group_size: int | None, observer: str = "minmax"):
        super().__init__(embedding, bits, group_size, observer)  # rows are its outputs, the width its inputs
        self.padding_idx, self.scale_grad_by_freq, self.sparse = (embedding.padding_idx, embedding.scale_grad_by_freq,
                                                                   embedding.sparse)
        self.num_embeddings, self.embedding_dim = embedding.num_embeddings, embedding.embedding_dim
        self.max_norm, self.norm_type = None, 2.0  # what nn.Embedding's readers find (is_table: no max_norm)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """The rows of the fake-quantized table.

        Args:
            ids: the token ids."""
        return F.embedding(ids, self.weight_fake_quant(self.live("weight")), self.padding_idx, None, 2.0,
                           self.scale_grad_by_freq, self.sparse)
