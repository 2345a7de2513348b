"""ONNX export: a float model as is (its pruned zeros intact), a QAT model as QuantizeLinear/DequantizeLinear.

QAT modules are replaced, in a copy of the model, by export modules whose quantization
parameters are constants and whose BatchNorm is already folded into the conv weight and
bias, so runtimes see ``DQ(x), DQ(w_int8) -> Conv -> (Relu) -> Q`` and fuse it. Each bias is
written on the int32 grid the int8 layer holds it on (:mod:`recal_torch.bias_grid`).

Under the default (dynamo) exporter the quantize/dequantize steps are written with
``torch.ops.quantized_decomposed`` (``torch.fake_quantize_*`` does not export there);
under ``dynamo=False`` with ``torch.fake_quantize_*``, which that exporter turns into QDQ.
"""

from __future__ import annotations

import copy
import logging
import os
import warnings
from pathlib import Path
from typing import Sequence

import torch
from torch import nn

from recal_core.atomic import atomic_folder

from .bias_grid import round_biases
from .export_modules import (ActivationQDQ, AttentionQDQ, QuantizedExportModule, QuantizedReLUExport,
                             decomposed_ops)
from .fake_quant import ActivationFakeQuantize
from .model_params import unwrap
from .qat_attention import AttentionFakeQuantize
from .qat_modules import QATModule, QuantizedReLU, qat_modules
from .qat_plan import plan_pending
from .qat_sites import CONTAINER

log = logging.getLogger(__name__)

MIN_DYNAMO_OPSET = 18  # the lowest opset torch's dynamo exporter implements (converting down fails for QDQ)
DEFAULT_TORCHSCRIPT_OPSET = 17
EXTERNAL_DATA_BYTES = 1_800_000_000


def _parameter_bytes(model: nn.Module) -> int:
    tensors = list(model.parameters()) + list(model.buffers())
    return sum(t.numel() * t.element_size() for t in tensors)


def to_export_model(model: nn.Module, dynamo: bool = True, sample_input: Sequence[torch.Tensor] | None = None
                    ) -> nn.Module:
    """An eval-mode copy of ``model`` whose QAT modules are export modules (the model is not changed).

    Args:
        model: a model (maybe wrapped in DDP) with QAT modules.
        dynamo: write quantize/dequantize as the dynamo exporter reads them (else as TorchScript's exporter does).
        sample_input: a tuple of the model's inputs; when given, each conv / linear bias is put on the int32 grid
            its int8 layer holds it on (:mod:`recal_torch.bias_grid`), as :func:`export_onnx` does."""
    model = unwrap(model)
    exported = copy.deepcopy(model)
    exported.eval()
    for name, module in list(exported.named_modules()):
        if isinstance(module, ActivationFakeQuantize) and CONTAINER in name.split("."):
            # a call site's observer, or one of a SiLU site's two (SiLUFakeQuantize keeps its own forward)
            parent_name, _, child = name.rpartition(".")
            setattr(exported.get_submodule(parent_name), child, ActivationQDQ(module, dynamo))
        elif isinstance(module, (QATModule, QuantizedReLU, AttentionFakeQuantize)):
            parent_name, _, child = name.rpartition(".")
            parent = exported.get_submodule(parent_name) if parent_name else exported
            replacement = (QuantizedExportModule(module, dynamo) if isinstance(module, QATModule)
                           else AttentionQDQ(module, dynamo) if isinstance(module, AttentionFakeQuantize)
                           else QuantizedReLUExport(module, dynamo))
            setattr(parent, child, replacement)
    if sample_input is not None:
        round_biases(exported, tuple(sample_input))
    return exported


def export_onnx(model: nn.Module, sample_input: torch.Tensor | Sequence[torch.Tensor], path: str | os.PathLike,
                opset: int | None = None, *, dynamo: bool = True, input_names: Sequence[str] = ("input",),
                output_names: Sequence[str] = ("output",), dynamic_batch: bool = True) -> Path:
    """Export ``model`` to ONNX at ``path`` (atomically); QAT models become QDQ models.

    Args:
        model: the model (float, QAT or thinned; maybe wrapped in DDP); not changed.
        sample_input: one input tensor, or a tuple of them.
        path: the ``.onnx`` file to write.
        opset: defaults to 18 under ``dynamo=True`` (torch's default exporter, which implements opset 18 and
            later: an older one is an error, not a silent upgrade) and to 17 under ``dynamo=False`` (13 or later
            for per-channel weights).
        dynamo: torch's default (dynamo) exporter, or the TorchScript one (``False``).
        input_names: the graph's input names.
        output_names: the graph's output names.
        dynamic_batch: declare the first axis of every input and output dynamic.

    >>> import torch, tempfile, os
    >>> m = torch.nn.Sequential(torch.nn.Linear(4, 2))
    >>> p = export_onnx(m, torch.randn(1, 4), os.path.join(tempfile.mkdtemp(), "m.onnx"), dynamo=False)
    >>> p.suffix
    '.onnx'
    """
    if isinstance(model, QATModule):
        raise TypeError("export the model that contains the QAT module, not the module itself")
    if opset is None:
        opset = MIN_DYNAMO_OPSET if dynamo else DEFAULT_TORCHSCRIPT_OPSET
    if dynamo and opset < MIN_DYNAMO_OPSET:
        raise ValueError(f"torch's default (dynamo) exporter writes opset {MIN_DYNAMO_OPSET} or later, not {opset}; "
                         f"pass opset>={MIN_DYNAMO_OPSET}, or dynamo=False for opset {opset}")
    inputs = tuple(sample_input) if isinstance(sample_input, (list, tuple)) else (sample_input,)
    if dynamo:
        decomposed_ops()  # before export: the exporter's registry maps these ops only if they exist
    plan_pending(unwrap(model), inputs)  # a QAT plan still waiting for the first forward is made on the sample
    export_model = to_export_model(model, dynamo, inputs)
    kwargs: dict = {"opset_version": opset, "input_names": list(input_names), "output_names": list(output_names)}
    if dynamo:
        kwargs["verbose"] = False
        if dynamic_batch:
            kwargs["dynamic_shapes"] = tuple({0: torch.export.Dim.DYNAMIC} for _ in inputs)
        # One file unless the weights need ONNX external data (protobuf's 2 GB limit).
        kwargs["external_data"] = _parameter_bytes(export_model) > EXTERNAL_DATA_BYTES
    elif dynamic_batch:
        kwargs["dynamic_axes"] = {name: {0: "batch"} for name in [*input_names, *output_names]}
    target = Path(path)
    with atomic_folder(target.parent) as folder, warnings.catch_warnings():
        # torch's exporters warn about their own internals (opset conversion, TorchScript deprecation).
        warnings.filterwarnings("ignore", module=r"torch\..*")
        warnings.filterwarnings("ignore", category=DeprecationWarning)
        with torch.no_grad():
            torch.onnx.export(export_model, inputs, str(folder / target.name), dynamo=dynamo, **kwargs)
    log.info("exported %s model to %s", "QAT" if qat_modules(model) else "float", path)
    return Path(path)
