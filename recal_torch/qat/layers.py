"""The QAT layers: a float Conv(-BN)(-ReLU), Linear(-ReLU) or Embedding rebuilt around its own Parameters.

``Conv(-BN)(-ReLU)`` and ``Linear(-ReLU)`` become one QAT module that simulates the BatchNorm-folded weights, so
the exported model is already folded and runtimes fuse it. Each QAT module adopts the float module's Parameter
objects (the optimizer and its momentum/Adam state carry on); the BatchNorm becomes a :class:`FoldedBatchNorm`
that keeps its parameters and statistics under the same names but passes its input through. Which layers become
QAT modules, and what they fuse, is the planner's choice (:mod:`recal_torch.qat.plan`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..sharding import gathered, unsharded_class
from .quantizers import W_LEVELS, ActivationFakeQuantize, WeightFakeQuantize

CONVS = (nn.Conv1d, nn.Conv2d, nn.Conv3d)


def is_transposed_linear_type(kind: type) -> bool:
    """transformers' ``Conv1D`` (GPT-2, DistilGPT-2 and their forks): a Linear whose weight is stored ``[in, out]``
    (``y = x @ W + b``), found by name so that recal needs no transformers import."""
    return kind.__name__ == "Conv1D" and kind.__module__.startswith("transformers")


def features(module: nn.Module) -> tuple[int, int]:
    """``(inputs, outputs)`` of one output row: a Linear's in/out features (a ``Conv1D`` reads its ``[in, out]``
    weight the other way round), an embedding's width and rows."""
    rows, cols = module.weight.shape[:2]
    return (rows, cols) if is_transposed_linear_type(unsharded_class(module)) else (cols, rows)


def is_linear_like(module: nn.Module) -> bool:
    """``nn.Linear``, transformers' ``Conv1D``, or a subclass of ``nn.Linear`` whose own ``forward`` computes
    what ``F.linear`` does (transformers' ``FalconLinear``: ``x @ W.T + b``): what QAT replaces by a QAT linear. A layer
    ``fully_shard`` wrapped is judged as the class it was."""
    kind = unsharded_class(module)
    if kind is nn.Linear or is_transposed_linear_type(kind):
        return True
    if isinstance(module, AdoptsParameters):  # recal's own (a QAT or weight-only layer), already quantized
        return False
    return isinstance(module, nn.Linear) and (kind.forward is nn.Linear.forward or _computes_linear(module))


@torch.no_grad()
def _computes_linear(module: nn.Linear) -> bool:
    """A subclass's ``forward`` on two random rows equals ``F.linear`` with its weight and bias (anything that adds
    to it, an adapter or a different product, does not, and stays the user's module)."""
    weight = module.weight
    if weight.is_meta or weight.dim() != 2 or not weight.dtype.is_floating_point:
        return False
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, weight.shape[1], generator=g).to(weight)
    try:
        y = module.forward(x)  # (not the module's hooks: a probe is no input of the model's)
    except Exception:  # noqa: BLE001 - a forward that needs more than one tensor is not a Linear's
        return False
    expected = F.linear(x, weight, module.bias)
    return isinstance(y, torch.Tensor) and y.shape == expected.shape and \
        bool(torch.allclose(y, expected, rtol=1e-3, atol=1e-3 * float(expected.abs().max()) + 1e-6))


def linears_left_float(root: nn.Module) -> list[str]:
    """Subclasses of ``nn.Linear`` QAT does not replace (their ``forward`` computes something else): named in a
    warning, each with its class."""
    return [f"{n} ({type(m).__name__})" for n, m in root.named_modules()
            if isinstance(m, nn.Linear) and not isinstance(m, AdoptsParameters) and not is_linear_like(m)]


NORMS = {nn.Conv1d: nn.BatchNorm1d, nn.Conv2d: nn.BatchNorm2d, nn.Conv3d: nn.BatchNorm3d}


# --- fused QAT modules ---------------------------------------------------------------------


def clamp(y: torch.Tensor, relu: bool, relu6: bool) -> torch.Tensor:
    """The fused activation of a QAT layer (and of its export form): ReLU6, ReLU or none."""
    return F.relu6(y) if relu6 else F.relu(y) if relu else y


class AdoptsParameters:
    """A module holding another module's Parameters as its own (a QAT layer, a folded BatchNorm): the optimizer,
    masks and checkpoints carry on. Under FSDP2 they stay the sharded DTensors ``fully_shard`` made, and for each
    forward it puts the gathered tensors on the module it recorded, the one adopted from: :meth:`live` reads them."""

    adopted_from: nn.Module

    def adopt_from(self, source: nn.Module) -> None:
        """Remember ``source`` (not a child: the model owns it, or it is gone from the model).

        Args:
            source: the module whose Parameters this one holds."""
        object.__setattr__(self, "adopted_from", source)

    def live(self, name: str) -> torch.Tensor | None:
        """Parameter ``name`` as the forward computes with it (gathered, under FSDP2).

        Args:
            name: ``"weight"`` or ``"bias"``."""
        return gathered(getattr(self, name), self.adopted_from, name)


class FoldedBatchNorm(AdoptsParameters, nn.Module):
    """A BatchNorm folded into the QAT conv before it: same parameters and statistics, identity forward."""

    def __init__(self, bn: nn.modules.batchnorm._BatchNorm):
        super().__init__()
        self.num_features, self.eps, self.momentum = bn.num_features, bn.eps, bn.momentum
        self.affine, self.track_running_stats = bn.affine, bn.track_running_stats
        self.original_type = unsharded_class(bn)
        self.adopt_from(bn)
        for name, param in bn.named_parameters(recurse=False):
            self.register_parameter(name, param)
        for name, buf in bn.named_buffers(recurse=False):
            self.register_buffer(name, buf)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def extra_repr(self) -> str:
        return f"{self.num_features}, folded into the preceding QAT conv"


class QATModule(AdoptsParameters, nn.Module):
    """Base of the QAT conv and linear: weight/bias are the float module's own Parameters. Each QAT layer is also an
    instance of the torch layer it replaces (a QAT linear made from an ``nn.Linear`` an ``nn.Linear``, a 2-D
    :class:`QATConv` an ``nn.Conv2d``, :class:`QATEmbedding` an ``nn.Embedding``): ``isinstance`` checks in the
    user's code and in libraries (parameter counts, PEFT target matching, Hugging Face weight init, wrap policies
    by class) find them, as torch.ao's QAT layers are found."""

    weight: nn.Parameter
    bias: nn.Parameter | None

    def __init__(self, float_module: nn.Module, relu: bool, quantize_input: bool, quantize_output: bool = True,
                 relu6: bool = False, weight_levels: float = W_LEVELS):
        nn.Module.__init__(self)  # not the layer class's own (it would make new Parameters): the float one's are kept
        self.float_type = unsharded_class(float_module)
        self.adopt_from(float_module)
        self.weight = float_module.weight
        self.register_parameter("bias", getattr(float_module, "bias", None))
        self.relu = relu
        self.relu6 = relu6  # ReLU6 / Hardtanh(0, 6): clamped before the output's range, as runtimes fold it
        self.input_fake_quant = ActivationFakeQuantize() if quantize_input else None
        self.weight_fake_quant = WeightFakeQuantize(self.weight.shape[0], weight_levels)
        self.activation_post_process = ActivationFakeQuantize() if quantize_output else None
        self.bn_frozen = False
        device = self.weight.device
        self.to(device)

    def folded_weight_and_bias(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The weight and bias with any BatchNorm folded in, from its running statistics."""
        return self.live("weight"), self.live("bias")

    @property
    def activation_name(self) -> str:
        return "ReLU6" if self.relu6 else "ReLU" if self.relu else ""

    def _finish(self, y: torch.Tensor) -> torch.Tensor:
        y = clamp(y, self.relu, self.relu6)
        return y if self.activation_post_process is None else self.activation_post_process(y)


class QATConv(QATModule):
    """Conv(-BN)(-ReLU) with fake-quantized input (optional), BN-folded weights and output; made as
    :class:`QATConv1d`, :class:`QATConv2d` or :class:`QATConv3d` (an ``nn.Conv1d`` ... too) for the conv's
    dimensions."""

    def __new__(cls, *args, **kwargs):  # (copy and pickle call it with no arguments, on the subclass)
        conv = args[0] if args else kwargs.get("conv")
        if cls is QATConv and conv is not None:
            cls = _QAT_CONVS[len(conv.kernel_size) - 1]
        return super().__new__(cls)

    def __init__(self, conv: nn.modules.conv._ConvNd, bn: FoldedBatchNorm | None, relu: bool,
                 quantize_input: bool, relu6: bool = False, weight_levels: float = W_LEVELS):
        super().__init__(conv, relu, quantize_input, relu6=relu6, weight_levels=weight_levels)
        self.stride, self.padding, self.dilation, self.groups = conv.stride, conv.padding, conv.dilation, conv.groups
        self.dims = len(conv.kernel_size)
        # what model code reads off a conv (Hugging Face's TF-style padding reads kernel_size)
        self.kernel_size, self.in_channels, self.out_channels = conv.kernel_size, conv.in_channels, conv.out_channels
        self.padding_mode = conv.padding_mode
        object.__setattr__(self, "folded_bn", bn)  # owned by the parent model, not a child here

    def _conv(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        conv = (F.conv1d, F.conv2d, F.conv3d)[self.dims - 1]
        return conv(x, weight, bias, self.stride, self.padding, self.dilation, self.groups)

    def _bn_scale(self) -> torch.Tensor:
        bn = self.folded_bn
        gamma = bn.live("weight") if bn.affine else torch.ones_like(bn.running_var)
        return gamma / torch.sqrt(bn.running_var + bn.eps)

    def folded_weight_and_bias(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        bn = self.folded_bn
        if bn is None:
            return self.live("weight"), self.live("bias")
        factor = self._bn_scale()
        weight = self.live("weight") * factor.reshape(-1, *([1] * (self.dims + 1)))
        beta = bn.live("bias") if bn.affine else torch.zeros_like(bn.running_mean)
        bias = self.live("bias") if self.bias is not None else torch.zeros_like(bn.running_mean)
        return weight, beta + (bias - bn.running_mean) * factor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The convolution of fake-quantized ``x`` with the fake-quantized (BatchNorm-folded) weight.

        Args:
            x: the layer's float input."""
        if self.input_fake_quant is not None:
            x = self.input_fake_quant(x)
        bn = self.folded_bn
        if bn is None:
            return self._finish(self._conv(x, self.weight_fake_quant(self.live("weight")), self.live("bias")))
        # Simulated folding: conv with quantized BN-scaled weights, then undo the scale and run
        # BatchNorm, which uses batch statistics while training (and updates the running ones).
        factor = self._bn_scale()
        shape = [1] * (self.dims + 1)  # the weight's axes after the first (a static count: fx traces this)
        y = self._conv(x, self.weight_fake_quant(self.live("weight") * factor.reshape(-1, *shape)), None)
        # in y's dtype: a bf16 conv output under autocast stays bf16, as in plain training (promoted, BatchNorm and
        # all that followed ran in float32 with conversions back and forth)
        y = y / factor.reshape(1, -1, *shape[1:]).to(y.dtype)
        if self.bias is not None:
            y = y + self.live("bias").reshape(1, -1, *shape[1:]).to(y.dtype)
        update = self.training and not self.bn_frozen and bn.track_running_stats
        momentum = bn.momentum
        if update:
            bn.num_batches_tracked.add_(1)
            if momentum is None:
                momentum = 1.0 / float(bn.num_batches_tracked)
        y = F.batch_norm(y, bn.running_mean, bn.running_var, bn.live("weight"), bn.live("bias"),
                         training=self.training and not self.bn_frozen, momentum=momentum or 0.0, eps=bn.eps)
        return self._finish(y)

    def extra_repr(self) -> str:
        parts = [self.float_type.__name__]
        parts += ["BatchNorm (folded)"] if self.folded_bn is not None else []
        parts += [self.activation_name] if self.activation_name else []
        return "-".join(parts) + f", weight {tuple(self.weight.shape)}"


class QATConv1d(QATConv, nn.Conv1d):
    """A 1-D :class:`QATConv`, an ``nn.Conv1d``."""


class QATConv2d(QATConv, nn.Conv2d):
    """A 2-D :class:`QATConv`, an ``nn.Conv2d``."""


class QATConv3d(QATConv, nn.Conv3d):
    """A 3-D :class:`QATConv`, an ``nn.Conv3d``."""


_QAT_CONVS = (QATConv1d, QATConv2d, QATConv3d)


class QATLinear(QATModule):
    """Linear(-ReLU) with fake-quantized input (optional), weight and output; made from an ``nn.Linear`` (or a
    subclass) as :class:`QATTorchLinear`, an ``nn.Linear`` too. One made from transformers' ``Conv1D`` (its weight
    ``[in, out]``) is no ``nn.Linear``: code reading its weight as one would read it transposed."""

    def __new__(cls, *args, **kwargs):  # (copy and pickle call it with no arguments, on the subclass)
        if cls is QATLinear and isinstance(args[0] if args else kwargs.get("linear"), nn.Linear):
            cls = QATTorchLinear
        return super().__new__(cls)

    def __init__(self, linear: nn.Module, relu: bool, quantize_input: bool, relu6: bool = False,
                 weight_levels: float = W_LEVELS):
        super().__init__(linear, relu, quantize_input, relu6=relu6, weight_levels=weight_levels)
        # transformers' Conv1D keeps its weight [in, out]: the QAT layer reads it transposed (the same Parameter)
        self.transposed = is_transposed_linear_type(unsharded_class(linear))
        self.in_features, self.out_features = features(linear)
        if self.transposed:
            self.weight_fake_quant = WeightFakeQuantize(self.out_features, weight_levels).to(self.weight.device)

    def folded_weight_and_bias(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The weight as ``[out, in]`` (a Conv1D's transposed) and the bias."""
        weight = self.live("weight")
        return (weight.t() if self.transposed else weight), self.live("bias")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The linear map of fake-quantized ``x`` by the fake-quantized weight.

        Args:
            x: the layer's float input."""
        if self.input_fake_quant is not None:
            x = self.input_fake_quant(x)
        weight, _ = self.folded_weight_and_bias()
        return self._finish(F.linear(x, self.weight_fake_quant(weight), self.live("bias")))

    def extra_repr(self) -> str:
        act = f"-{self.activation_name}" if self.activation_name else ""
        return f"Linear{act}, weight {tuple(self.weight.shape)}"


class QATTorchLinear(QATLinear, nn.Linear):
    """A :class:`QATLinear` made from an ``nn.Linear``, an ``nn.Linear``."""


class QATEmbedding(QATModule, nn.Embedding):
    """An embedding table read through int8 symmetric per-row fake quantization; the rows it returns are float.

    The int8 model stores the table in int8 and gathers integer rows (a 4x smaller file; the dominant
    tensor of a transformer's checkpoint at small widths).
    """

    def __init__(self, embedding: nn.Embedding):
        super().__init__(embedding, relu=False, quantize_input=False, quantize_output=False)
        self.num_embeddings, self.embedding_dim = embedding.num_embeddings, embedding.embedding_dim
        self.padding_idx, self.max_norm, self.norm_type = embedding.padding_idx, embedding.max_norm, embedding.norm_type
        self.scale_grad_by_freq, self.sparse = embedding.scale_grad_by_freq, embedding.sparse

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight_fake_quant(self.live("weight")), self.padding_idx, None, self.norm_type,
                           self.scale_grad_by_freq, self.sparse)

    def extra_repr(self) -> str:
        return f"Embedding, int8 per-row table {tuple(self.weight.shape)}"


class QuantizedReLU(nn.Module):
    """A ReLU after a residual sum ``a + b`` whose output is fake-quantized: runtimes then add in int8
    (the ReLU is the clamp of the add's uint8 output, whose zero point is 0).

    Swapped in for a ``nn.ReLU`` module that only follows an addition (ResNet blocks).
    """

    def __init__(self):
        super().__init__()
        self.activation_post_process = ActivationFakeQuantize()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.activation_post_process(F.relu(x))


def is_table(module: nn.Module) -> bool:
    """An embedding table QAT stores in int8 (``max_norm`` rewrites rows during lookup: left float)."""
    return unsharded_class(module) is nn.Embedding and module.max_norm is None


def device_of(module: nn.Module) -> torch.device:
    return next((p.device for p in module.parameters()), torch.device("cpu"))


