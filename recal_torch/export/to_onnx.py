"""ONNX export: a float model as is (its pruned zeros intact), a QAT model as QuantizeLinear/DequantizeLinear.

QAT modules are replaced, in a copy of the model, by export modules whose quantization
parameters are constants and whose BatchNorm is already folded into the conv weight and
bias, so runtimes see ``DQ(x), DQ(w_int8) -> Conv -> (Relu) -> Q`` and fuse it. Each bias is
written on the int32 grid the int8 layer holds it on (:mod:`recal_torch.export.bias_grid`).

Under the default (dynamo) exporter the quantize/dequantize steps are written with
``torch.ops.quantized_decomposed`` (``torch.fake_quantize_*`` does not export there);
under ``dynamo=False`` with ``torch.fake_quantize_*``, which that exporter turns into QDQ.
"""

from __future__ import annotations

import copy
import inspect
import logging
import os
import re
import warnings
from pathlib import Path
from typing import Sequence

import torch
from torch import nn

from recal_core.atomic import atomic_folder

from ..errors import ExportError, ExportWarning
from ..model_params import unwrap
from ..sharding import is_sharded
from ..qat import (CONTAINER, ActivationFakeQuantize, AttentionFakeQuantize, GroupWeightFakeQuantize, QATModule,
                   QuantizedReLU, WeightFakeQuantize, WeightOnlyLinear, adopt, plan_pending, qat_modules)
from .bias_grid import round_biases
from .modules import (ActivationQDQ, AttentionQDQ, QuantizedExportModule, QuantizedReLUExport, WeightOnlyExport,
                      decomposed_ops)

log = logging.getLogger(__name__)

MIN_DYNAMO_OPSET = 18  # the lowest opset torch's dynamo exporter implements (converting down fails for QDQ)
DEFAULT_TORCHSCRIPT_OPSET = 17
EXTERNAL_DATA_BYTES = 1_800_000_000


def _takes_varargs(model: nn.Module) -> bool:
    """``forward(self, *inputs)``: torch.export then wants the inputs' dynamic shapes as one tuple."""
    params = list(inspect.signature(model.forward).parameters.values())
    return bool(params) and params[0].kind is inspect.Parameter.VAR_POSITIONAL


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
            its int8 layer holds it on (:mod:`recal_torch.export.bias_grid`), as :func:`export_onnx` does."""
    model = unwrap(model)
    # the weights of the layers swapped below are only read (into integer weights and scales): the copy shares
    # them rather than holding a second set (a 0.6 B decoder: 2.4 GB less at export)
    shared = {id(m.weight): m.weight for m in model.modules()
              if isinstance(m, (QATModule, WeightOnlyLinear)) and isinstance(getattr(m, "weight", None), torch.Tensor)}
    exported = copy.deepcopy(model, memo=dict(shared))
    exported.eval()
    for name, module in list(exported.named_modules()):
        if isinstance(module, ActivationFakeQuantize) and CONTAINER in name.split("."):
            # a call site's observer, or one of a SiLU site's two (SiLUFakeQuantize keeps its own forward)
            parent_name, _, child = name.rpartition(".")
            replacement = ActivationQDQ(module, dynamo)
            adopt(module, replacement)
            setattr(exported.get_submodule(parent_name), child, replacement)
        elif isinstance(module, (QATModule, QuantizedReLU, AttentionFakeQuantize, WeightOnlyLinear)):
            parent_name, _, child = name.rpartition(".")
            parent = exported.get_submodule(parent_name) if parent_name else exported
            replacement = (QuantizedExportModule(module, dynamo) if isinstance(module, QATModule)
                           else WeightOnlyExport(module, dynamo) if isinstance(module, WeightOnlyLinear)
                           else AttentionQDQ(module, dynamo) if isinstance(module, AttentionFakeQuantize)
                           else QuantizedReLUExport(module, dynamo))
            adopt(module, replacement)
            setattr(parent, child, replacement)
    if sample_input is not None:
        round_biases(exported, tuple(sample_input))
    return exported


def export_onnx(model: nn.Module, sample_input: torch.Tensor | Sequence[torch.Tensor], path: str | os.PathLike,
                opset: int | None = None, *, dynamo: bool = True, input_names: Sequence[str] = ("input",),
                output_names: Sequence[str] = ("output",), dynamic_batch: bool = True,
                dynamic_sequence: bool = False) -> Path:
    """Export ``model`` to ONNX at ``path`` (atomically); QAT models become QDQ models.

    The exporter asked for goes first. When it fails, or writes a dynamic batch its graph cannot run (a Reshape
    fixed to the sample's batch: onnxruntime runs the written model on the sample repeated to one more row to
    find out), the other exporter is used, with an :class:`ExportWarning` saying why; when both fail,
    :class:`ExportError` gives both reasons. Nothing is written unless a model that runs is.

    Args:
        model: the model (float, QAT or thinned; maybe wrapped in DDP); not changed.
        sample_input: one input tensor, or a tuple of them.
        path: the ``.onnx`` file to write.
        opset: defaults to 18 under ``dynamo=True`` (torch's default (dynamo) exporter, which implements opset 18
            and later: an older one is an error, not a silent upgrade) and to 17 under ``dynamo=False`` (13 or
            later for per-channel weights).
        dynamo: try torch's default (dynamo) exporter first, or the TorchScript one (``False``).
        input_names: the graph's input names.
        output_names: the graph's output names.
        dynamic_batch: declare the first axis of every input and output dynamic.
        dynamic_sequence: declare the second axis (tokens) of every input and output dynamic too: one model for
            a prompt of any length and for one token at a time (a decoder exported with ``use_cache=False``).

    >>> import torch, tempfile, os
    >>> m = torch.nn.Sequential(torch.nn.Linear(4, 2))
    >>> p = export_onnx(m, torch.randn(1, 4), os.path.join(tempfile.mkdtemp(), "m.onnx"), dynamo=False)
    >>> p.suffix
    '.onnx'
    """
    if isinstance(model, QATModule):
        raise TypeError("export the model that contains the QAT module, not the module itself")
    sharded = next((name for name, p in model.named_parameters() if is_sharded(p)), None)
    if sharded is not None:
        raise ValueError(
            f"{type(unwrap(model)).__name__} is sharded with fully_shard (FSDP2) ({sharded} is a DTensor): export "
            "needs whole weights. On every rank, gather them (torch.distributed.checkpoint.state_dict."
            "get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))) and take "
            "manager.state_dict(); then, in one process, build the model, modify it with the same recipe, "
            "manager.load_state_dict(that state), model.load_state_dict(the gathered weights), and export that")
    if dynamo and opset is not None and opset < MIN_DYNAMO_OPSET:
        raise ValueError(f"torch's default (dynamo) exporter writes opset {MIN_DYNAMO_OPSET} or later, not {opset}; "
                         f"pass opset>={MIN_DYNAMO_OPSET}, or dynamo=False for opset {opset}")
    inputs = tuple(sample_input) if isinstance(sample_input, (list, tuple)) else (sample_input,)
    plan_pending(unwrap(model), inputs)  # a QAT plan still waiting for the first forward is made on the sample
    _refuse_bad_scales(unwrap(model))
    names = (tuple(input_names), tuple(output_names))
    axes = (0, 1) if dynamic_sequence else (0,) if dynamic_batch else ()
    target = Path(path)
    with atomic_folder(target.parent) as folder:
        file = folder / target.name
        problem = _export_and_check(model, inputs, file, dynamo, opset, names, axes)
        if problem is not None:
            other = "TorchScript" if dynamo else "dynamo"
            for item in folder.iterdir():
                item.unlink()
            fallback = None if opset is None else max(opset, MIN_DYNAMO_OPSET) if not dynamo else opset
            second = _export_and_check(model, inputs, file, not dynamo, fallback, names, axes)
            if second is not None:
                raise ExportError(f"neither of torch's exporters exported {type(unwrap(model)).__name__}: the "
                                  f"{'dynamo' if dynamo else 'TorchScript'} exporter {problem}; the {other} exporter "
                                  f"{second}")
            warnings.warn(f"the {'dynamo' if dynamo else 'TorchScript'} exporter {problem}; {target.name} was exported "
                          f"with the {other} exporter (dynamo={not dynamo})", ExportWarning, stacklevel=2)
    quantized = qat_modules(model) or any(isinstance(m, WeightOnlyLinear) for m in unwrap(model).modules())
    log.info("exported %s model to %s", "QAT" if quantized else "float", path)
    return Path(path)


def _refuse_bad_scales(model: nn.Module) -> None:
    """A quantizer whose scale is zero, negative or not finite (a learned scale set so by hand or loaded so; a NaN
    from a diverged run) would be written as a grid that flips signs or divides by zero: a ``ValueError`` naming
    it, before anything is written."""
    for name, module in model.named_modules():
        if isinstance(module, ActivationFakeQuantize) and not (module.active and module.has_observed):
            continue
        if isinstance(module, (ActivationFakeQuantize, WeightFakeQuantize, GroupWeightFakeQuantize)):
            scale = module.scale.detach()
            bad = ~torch.isfinite(scale) | (scale <= 0)
            if bool(bad.any()):
                value = float(scale.reshape(-1)[bad.reshape(-1)][0])
                kind = "learned " if module.learned else ""
                raise ValueError(f"the {kind}quantization scale {name}.scale is {value:g} (in {int(bad.sum())} of "
                                 f"{scale.numel()} channels); a scale must be positive and finite: retrain or reload "
                                 "it (learned scales are held at or above float32's eps after every step)")


def _first_line(exc: BaseException) -> str:
    """The root cause of ``exc`` (torch's exporters wrap the model's own error), on one line, without colours."""
    while exc.__cause__ is not None:
        exc = exc.__cause__
    lines = [line.strip() for line in re.sub(r"\x1b\[[0-9;]*m", "", str(exc)).splitlines() if line.strip()]
    return f"{type(exc).__name__}: {(lines or [''])[0][:300]}"


def _export_and_check(model: nn.Module, inputs: tuple, file: Path, dynamo: bool, opset: int | None,
                      names: tuple, axes: tuple[int, ...]) -> str | None:
    """Export with one exporter to ``file``; None when it wrote a model that runs, else what went wrong."""
    if opset is None:
        opset = MIN_DYNAMO_OPSET if dynamo else DEFAULT_TORCHSCRIPT_OPSET
    if dynamo:
        decomposed_ops()  # before export: the exporter's registry maps these ops only if they exist
    export_model = to_export_model(model, dynamo, inputs)  # recal's own errors (an unobserved range) go to the user
    try:
        kwargs: dict = {"opset_version": opset, "input_names": list(names[0]), "output_names": list(names[1])}
        if dynamo:
            kwargs["verbose"] = False
            if axes:
                shapes = tuple({axis: torch.export.Dim.DYNAMIC for axis in axes} for _ in inputs)
                kwargs["dynamic_shapes"] = (shapes,) if _takes_varargs(export_model) else shapes
            # One file unless the weights need ONNX external data (protobuf's 2 GB limit).
            kwargs["external_data"] = _parameter_bytes(export_model) > EXTERNAL_DATA_BYTES
        elif axes:
            labels = {0: "batch", 1: "sequence"}
            kwargs["dynamic_axes"] = {name: {axis: labels[axis] for axis in axes} for name in [*names[0], *names[1]]}
        registry = logging.getLogger("torch.onnx._internal.exporter._registration")
        level = registry.level
        with warnings.catch_warnings():
            # torch's exporters warn about their own internals (opset conversion, TorchScript deprecation, pytree's
            # LeafSpec through copyreg) and log that torchvision's ops (nms, roi_align...) are not registered
            # without it: nothing a user's model needs, printed on every first export
            warnings.filterwarnings("ignore", module=r"torch\..*")
            warnings.filterwarnings("ignore", category=DeprecationWarning)
            warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated")
            registry.setLevel(max(level, logging.ERROR))
            try:
                with torch.no_grad():
                    torch.onnx.export(export_model, inputs, str(file), dynamo=dynamo, **kwargs)
            finally:
                registry.setLevel(level)
    except Exception as exc:  # noqa: BLE001 - torch's exporters raise many types; the fallback says which
        return f"failed ({_first_line(exc)})"
    return _batch_problem(file, inputs, names[0], 1 in axes) if 0 in axes else None


def _batch_problem(file: Path, inputs: tuple, input_names: Sequence[str], sequence: bool = False) -> str | None:
    """Run the written model on the sample grown by one row (and, with ``sequence``, shortened by one token): a
    graph that fixed the sample's batch or length somewhere (a Reshape) fails here rather than in the user's first
    batch. Skipped without onnxruntime."""
    try:
        import onnxruntime as ort
    except ImportError:
        return None
    tensors = [t for t in inputs if isinstance(t, torch.Tensor)]
    if len(tensors) != len(inputs) or not tensors or any(t.dim() == 0 for t in tensors):
        return None
    sequence = sequence and all(t.dim() >= 2 and t.shape[1] > 1 for t in tensors)
    feeds = {name: torch.cat([t, t[:1]])[:, :-1 if sequence else None].detach().cpu().numpy()
             for name, t in zip(input_names, tensors)}
    try:
        options = ort.SessionOptions()
        options.log_severity_level = 3
        # the basic optimizations (where a fixed shape shows, as in a default session), not the constant folding or
        # the fusions that turn a QDQ decoder's weights to float all at once (2.4 GB for 0.6 B weights), and its ops
        # in priority order: weights dequantized a layer at a time (1.1 GB)
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
        options.execution_order = ort.ExecutionOrder.PRIORITY_BASED
        session = ort.InferenceSession(str(file), options, providers=["CPUExecutionProvider"],
                                       disabled_optimizers=["ConstantFolding"])
        known = {i.name for i in session.get_inputs()}
        session.run(None, {k: v for k, v in feeds.items() if k in known})
    except Exception as exc:  # noqa: BLE001 - onnxruntime's errors are plain RuntimeErrors with its own types
        shape = next(iter(feeds.values())).shape
        where = f"batch {shape[0]}, sequence {shape[1]}" if sequence else f"batch {shape[0]}"
        return (f"wrote a dynamic {'batch and sequence' if sequence else 'batch'} its graph cannot run (at {where}: "
                f"{_first_line(exc)})")
    return None
