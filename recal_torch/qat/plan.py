"""The QAT planner: which layers of a model become QAT modules, what each fuses, which tensors are quantized.

A ``nn.ReLU`` module that follows a residual addition becomes a :class:`QuantizedReLU`, which
quantizes the sum, so the addition runs in int8 too; other residual adds (no activation after them, a shared
or functional ReLU) get an observer at their call site (:mod:`recal_torch.qat.sites`).

Which outputs are quantized is read off a ``torch.fx`` trace of the model: every QAT
module quantizes its output, and its input only when that input does not already come
from a QAT module through quantization-preserving ops (max-pool, flatten, ReLU ...).
A model fx cannot trace (Hugging Face models check shapes in Python) is planned the same way from a
recording of its first forward (:mod:`recal_torch.qat.trace`).
"""

from __future__ import annotations

import logging
import warnings
from collections import Counter

import torch
from torch import nn

from ..errors import QATPlanWarning
from ..sharding import forward_to_trace, is_sharded_module, take_over
from . import sites as qat_sites
from .quantizers import REDUCED_W_LEVELS, W_LEVELS, ActivationFakeQuantize, SiLUFakeQuantize, WeightFakeQuantize
from .attention import AttentionFakeQuantize
from .fusion_plan import FusionPlan, plan_graph, plan_sites, reaches, site_kind, unread_linears
from .layers import (CONVS, AdoptsParameters, FoldedBatchNorm, QATConv, QATEmbedding, QATLinear, QATModule,
                     QuantizedReLU, device_of, is_linear_like, is_table)
from .weight_only import WeightOnlyLinear
from .patterns import (identity_at_eval,
                           norm_activation)
from .trace import evaluating, record_forward

log = logging.getLogger(__name__)


FLOAT_REASON = "_recal_float_reason"  # on a conv / linear the planner left float: why (manager.quantized_layers)





def quantizable_layers(root: nn.Module, skip: frozenset[str] | set[str] = frozenset()) -> list[str]:
    """Names of the Conv1d/2d/3d (zero padding), Linear, transformers Conv1D and Embedding modules QAT can quantize,
    less ``skip``."""
    return [n for n, m in root.named_modules()
            if not isinstance(m, (QATModule, WeightOnlyLinear))  # recal's own layers are these classes too
            and ((isinstance(m, CONVS) and m.padding_mode == "zeros") or is_linear_like(m) or is_table(m))
            and n not in skip]


def fake_quantize_model(root: nn.Module, skip: frozenset[str] | set[str] = frozenset(),
                        reduce_range: bool = False) -> list[QATModule]:
    """Turn ``root``'s quantizable layers into QAT modules, in place; return them.

    Args:
        root: the model (or the submodule a recipe's ``submodules`` names); changed in place.
        skip: names (relative to ``root``) of layers to leave float.
        reduce_range: 7-bit conv / linear weights (``|q| <= 64``), which every x86 CPU's u8s8 kernels compute
            exactly; 8-bit (``|q| <= 127``) otherwise. Embedding tables stay 8-bit (gathered, never multiplied).

    Returns:
        The QAT modules created, in the order of ``root.named_modules()``.

    Not torch.ao's ``prepare_qat``: Conv(-BN)(-ReLU) and Linear(-ReLU) are fused into one QAT
    module each (BatchNorm folded into the simulated weights) that keeps the float module's
    Parameter objects, and the fake-quantizers are recal's own (uint8 activations, int8
    symmetric per-channel weights, int8 per-row embedding tables). The recipe's QuantizationModifier
    calls this at its start. The layers named in ``skip`` stay float (the layers after them quantize
    their own inputs).

    The plan is read off a ``torch.fx`` trace. A model fx cannot trace (Hugging Face transformers,
    data-dependent control flow) is planned from its first forward instead (:func:`_plan_on_first_forward`).
    """
    levels = REDUCED_W_LEVELS if reduce_range else W_LEVELS
    modules = dict(root.named_modules())
    traced = True
    try:
        plans, residual_relus = _plan_from_trace(root, modules, skip)
    except Exception as exc:  # noqa: BLE001 - any tracing failure: the plan is made from the first forward
        traced = False
        if type(root).forward is nn.Module.forward:  # a LightningModule whose training_step calls self.net(x)
            children = [n for n, m in root.named_children() if type(m).forward is not nn.Module.forward]
            warnings.warn(f"QAT: {type(root).__name__} has no forward(), so the first forward its plan is made from "
                          "never comes: its layers stay unfused (no BatchNorm folded, every input and output "
                          "quantized) and the export will not match onnxruntime's integer kernels; name the module "
                          "that does run in the QuantizationModifier's submodules"
                          + (f" (submodules: [{children[0]}])" if children else ""), QATPlanWarning, stacklevel=3)
        log.info("QAT: torch.fx cannot trace %s (%s: %s); the plan is made from its first forward instead",
                 type(root).__name__, type(exc).__name__, " ".join(str(exc).split())[:200])
        plans, residual_relus = [FusionPlan(name) for name in quantizable_layers(root, skip)], []
    for name in residual_relus:
        replace_layer(root, name, QuantizedReLU().to(device_of(root)))
    created = []
    for plan in plans:
        float_module = modules[plan.target]
        if is_table(float_module):
            qat: QATModule = QATEmbedding(float_module)
        elif isinstance(float_module, CONVS):
            qat = QATConv(float_module, None, False, plan.quantize_input, weight_levels=levels)
        else:
            qat = QATLinear(float_module, False, plan.quantize_input, weight_levels=levels)
        qat.train(float_module.training)
        qat = replace_layer(root, plan.target, qat)
        _fuse(root, qat, plan, modules)
        created.append(qat)
    root.__dict__["_recal_pending_plan"] = traced
    if not root.__dict__.get("_recal_plan_hooked"):
        root.__dict__["_recal_plan_hooked"] = True
        root.register_forward_pre_hook(_plan_on_first_forward, with_kwargs=True)
        root.register_load_state_dict_pre_hook(qat_sites.restore)
    return created


def _fuse(root: nn.Module, qat: QATModule, plan: FusionPlan, modules: dict[str, nn.Module]) -> None:
    """Fold the plan's BatchNorm and activation into ``qat``."""
    if plan.bn is not None:
        bn = FoldedBatchNorm(modules[plan.bn])
        object.__setattr__(qat, "folded_bn", replace_layer(root, plan.bn, bn))
    if plan.activation is not None:
        qat.relu, qat.relu6 = plan.activation == "relu", plan.activation == "relu6"
    if plan.fused_module is not None:
        replace_layer(root, plan.fused_module, nn.Identity())


def is_leaf(module: nn.Module) -> bool:
    """A module the plan treats as one op (what runs inside it is not planned)."""
    return isinstance(module, (QATModule, WeightOnlyLinear, QuantizedReLU, FoldedBatchNorm, ActivationFakeQuantize,
                               WeightFakeQuantize, SiLUFakeQuantize, AttentionFakeQuantize)) \
        or norm_activation(module) is not None or not any(True for _ in module.children())


def plan_pending(root: nn.Module, args: tuple, kwargs: dict | None = None) -> None:
    """Make the first-forward plans waiting in ``root`` (it, or QAT roots inside it) now, on ``args`` (before
    export, whose deep copy must not plan on its own)."""
    if any(m.__dict__.get("_recal_pending_plan") is not None for m in root.modules()):
        with evaluating(root):
            root(*args, **(kwargs or {}))


@torch.compiler.disable  # under torch.compile the recording runs eagerly (a graph break), then compiling resumes
def _plan_on_first_forward(root: nn.Module, args: tuple, kwargs: dict) -> None:
    """The plan read off the first forward (a forward pre-hook of ``root``; runs once per QAT start).

    One forward is recorded (:mod:`recal_torch.qat.trace`, eval mode, no gradients). A model torch.fx could not
    trace gets its fusions here: BatchNorm folded, ReLU / ReLU6 folded into the layer's output range. Then, for
    every model: a residual add or a product whose operands are both quantized gets its own observer on its output
    (or on the ReLU / ReLU6 that alone reads it), and so does a sigmoid or SiLU of a quantized tensor (a SiLU on
    its sigmoid too), by call site (:mod:`recal_torch.qat.sites`); a layer whose input is
    already quantized (through max-pool, flatten, ReLU ...) switches its input quantizer off; in a model fx
    could not trace, a linear's output stays float unless a quantized layer or add reads it. The switches are
    buffers and the observers are in ``root.recal_sites``: checkpoints carry the plan.
    """
    traced = root.__dict__.pop("_recal_pending_plan", None)
    if traced is None:
        return
    try:
        graph = record_forward(root, tuple(args), dict(kwargs), is_leaf)
    except Exception as exc:  # noqa: BLE001 - the model still trains with the plan made so far
        layers = [n for n, m in root.named_modules() if isinstance(m, QATModule) and not isinstance(m, QATEmbedding)]
        shown = ", ".join(layers[:8]) + (f" and {len(layers) - 8} more" if len(layers) > 8 else "")
        warnings.warn(f"QAT: could not record the first forward of {type(root).__name__} ({type(exc).__name__}: "
                      f"{' '.join(str(exc).split())[:200]}): residual adds, products and sigmoids stay float"
                      f"{'' if traced else '; BatchNorm stays unfolded and every input and output is quantized'} "
                      f"for {shown}", QATPlanWarning, stacklevel=2)
        return
    modules = dict(root.named_modules())
    layers = {n for n, m in modules.items() if isinstance(m, QATModule) and not isinstance(m, QATEmbedding)}
    reached = {n.target for n in graph.nodes if n.op == "call_module"}
    unseen = sorted(layers - reached)
    if unseen:  # a branch the first forward did not take: no add, product or folding planned around them
        warnings.warn(f"QAT: the first forward of {type(root).__name__} did not reach {', '.join(unseen[:8])}"
                      f"{f' and {len(unseen) - 8} more' if len(unseen) > 8 else ''} (a branch not taken?): their "
                      "inputs and outputs are quantized as planned before it, and the adds, products and pools around "
                      "them stay float", QATPlanWarning, stacklevel=2)
    if not traced:
        plans, _ = plan_graph(graph, modules, layers)
        for plan in plans:
            _fuse(root, modules[plan.target], plan, modules)
        modules = dict(root.named_modules())
    sites, quantized = plan_sites(graph, modules)
    if sites:
        qat_sites.install(root, [node.meta["site"] for node in sites])
    if not traced:  # the int8 model's matmul returns float where no quantized layer or add reads its output
        for linear in unread_linears(graph, modules, set(sites)):
            linear.activation_post_process.set_active(False)
    for node in graph.nodes:
        layer = modules.get(node.target) if node.op == "call_module" else None
        if isinstance(layer, QATModule) and not isinstance(layer, QATEmbedding) and layer.input_fake_quant is not None \
                and node.args and reaches(node.args[0], quantized, modules):
            layer.input_fake_quant.set_active(False)
    fused = sum(isinstance(modules[n], QATConv) and modules[n].folded_bn is not None for n in layers)
    inputs = sum(modules[n].input_fake_quant is not None and modules[n].input_fake_quant.active for n in layers)
    outputs = sum(modules[n].activation_post_process is not None and modules[n].activation_post_process.active
                  for n in layers)
    log.info("QAT plan from the first forward of %s: %d layers (%d with BatchNorm folded), %d inputs and %d outputs "
             "quantized, %s", type(root).__name__, len(layers), fused, inputs, outputs,
             ", ".join(f"{n} {kind}s" for kind, n in Counter(site_kind(s, modules) for s in sites).items())
             or "no call sites")


_HOOK_DICTS = ("_forward_pre_hooks", "_forward_hooks", "_forward_hooks_with_kwargs", "_forward_pre_hooks_with_kwargs",
               "_forward_hooks_always_called")


def replace_layer(root: nn.Module, target: str, new: nn.Module) -> nn.Module:
    """Put ``new`` where ``target`` is, and return what stands there now. The user's forward hooks go with a layer to
    its QAT module; on a module that folds away (a BatchNorm or ReLU taken into the conv before it) they would no
    longer see what they saw: said. A layer ``fully_shard`` wrapped itself becomes ``new`` in place (FSDP2 gathers
    its parameters in its own forward: :func:`~recal_torch.sharding.take_over`)."""
    parent_name, _, child = target.rpartition(".")
    parent = root.get_submodule(parent_name) if parent_name else root
    old = getattr(parent, child)
    if is_sharded_module(old) and isinstance(new, AdoptsParameters):
        return take_over(old, new)
    if any(getattr(old, d, None) for d in ("_forward_pre_hooks", "_forward_hooks")):
        if isinstance(new, (QATModule, WeightOnlyLinear)):
            for name in _HOOK_DICTS:
                if getattr(old, name, None):
                    getattr(new, name).update(getattr(old, name))
        else:
            warnings.warn(f"QAT: {target!r} ({type(old).__name__}) has forward hooks, and QAT folds it into the layer "
                          "before it: its hooks now see that layer's folded output (register them on the layer)",
                          QATPlanWarning, stacklevel=4)
    setattr(parent, child, new)
    return new


def _plan_from_trace(root: nn.Module, modules: dict[str, nn.Module],
                     skip: frozenset[str] | set[str]) -> tuple[list[FusionPlan], list[str]]:
    """The fusion plans read off a ``torch.fx`` trace, and the ReLU modules that follow a residual addition."""
    quantizable = set(quantizable_layers(root, skip))
    graph = _LayerTracer(set(quantizable_layers(root))).trace(root)
    calls = Counter(n.target for n in graph.nodes if n.op == "call_module")
    shared = sorted(t for t, n in calls.items() if n > 1 and t in quantizable)
    if shared:  # one weight, several call sites: one input and output observer cannot hold each site's range
        warnings.warn(f"QAT: {', '.join(f'{t!r} ({calls[t]} calls)' for t in shared)} called more than once in "
                      f"{type(root).__name__}'s forward: left float (one observer cannot hold each call's range); "
                      "give each call its own module", QATPlanWarning, stacklevel=3)
        for target in shared:
            modules[target].__dict__[FLOAT_REASON] = f"called {calls[target]} times in one forward"
    return plan_graph(graph, modules, quantizable)


class _LayerTracer(torch.fx.Tracer):
    """fx's tracer, with every quantizable layer a leaf: a subclass of ``nn.Conv2d`` defined outside torch.nn
    (Hugging Face's depthwise conv) would otherwise be traced through to ``F.conv2d`` and never planned."""

    def __init__(self, layers: set[str]):
        super().__init__()
        self.layers = layers

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return qualname in self.layers or identity_at_eval(m) or norm_activation(m) is not None \
            or super().is_leaf_module(m, qualname)

    def call_module(self, m: nn.Module, forward, args, kwargs):
        if not self.is_leaf_module(m, self.path_of_module(m)):
            forward = forward_to_trace(m, forward)  # a block fully_shard wrapped: its forward, not FSDP2's hooks
        return super().call_module(m, forward, args, kwargs)


