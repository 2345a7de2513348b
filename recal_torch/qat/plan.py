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
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..sharding import forward_to_trace, is_sharded_module, take_over
from . import sites as qat_sites
from .quantizers import REDUCED_W_LEVELS, W_LEVELS, ActivationFakeQuantize, SiLUFakeQuantize, WeightFakeQuantize
from .attention import AttentionFakeQuantize
from .layers import (CONVS, NORMS, AdoptsParameters, FoldedBatchNorm, QATConv, QATEmbedding, QATLinear, QATModule,
                     QuantizedReLU, WeightOnlyLinear, device_of, is_linear_like, is_table)
from .patterns import (AVG_POOL_FUNCTIONS, AVG_POOLS, CATS, clamping_activation, identity_at_eval,
                           is_silu_module, norm_activation, preserves_quantization)
from .trace import ADDS, MULS, evaluating, own_children, record_forward

log = logging.getLogger(__name__)


FLOAT_REASON = "_recal_float_reason"  # on a conv / linear the planner left float: why (manager.quantized_layers)


class QATPlanWarning(UserWarning):
    """The QAT planner could not read the model's forward: the layers it names are quantized less than they could
    be (the message says what stays float)."""

# --- preparing a model ---------------------------------------------------------------------

@dataclass
class _Plan:
    target: str
    bn: str | None = None
    fused_module: str | None = None  # the activation module fused (it becomes nn.Identity)
    quantize_input: bool = True
    activation: str | None = None  # "relu" or "relu6": clamped before the output is quantized




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
        plans, residual_relus = [_Plan(name) for name in quantizable_layers(root, skip)], []
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


def _fuse(root: nn.Module, qat: QATModule, plan: _Plan, modules: dict[str, nn.Module]) -> None:
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
                               WeightFakeQuantize, SiLUFakeQuantize, AttentionFakeQuantize)) or norm_activation(module) is not None \
        or not any(True for _ in module.children())


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
        plans, _ = _plan_graph(graph, modules, layers)
        for plan in plans:
            _fuse(root, modules[plan.target], plan, modules)
        modules = dict(root.named_modules())
    sites, quantized = _plan_sites(graph, modules)
    if sites:
        qat_sites.install(root, [node.meta["site"] for node in sites])
    if not traced:  # the int8 model's matmul returns float where no quantized layer or add reads its output
        for linear in _unread_linears(graph, modules, set(sites)):
            linear.activation_post_process.set_active(False)
    for node in graph.nodes:
        layer = modules.get(node.target) if node.op == "call_module" else None
        if isinstance(layer, QATModule) and not isinstance(layer, QATEmbedding) and layer.input_fake_quant is not None \
                and node.args and _reaches(node.args[0], quantized, modules):
            layer.input_fake_quant.set_active(False)
    fused = sum(isinstance(modules[n], QATConv) and modules[n].folded_bn is not None for n in layers)
    inputs = sum(modules[n].input_fake_quant is not None and modules[n].input_fake_quant.active for n in layers)
    outputs = sum(modules[n].activation_post_process is not None and modules[n].activation_post_process.active
                  for n in layers)
    log.info("QAT plan from the first forward of %s: %d layers (%d with BatchNorm folded), %d inputs and %d outputs "
             "quantized, %s", type(root).__name__, len(layers), fused, inputs, outputs,
             ", ".join(f"{n} {kind}s" for kind, n in Counter(_site_kind(s, modules) for s in sites).items())
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
                     skip: frozenset[str] | set[str]) -> tuple[list[_Plan], list[str]]:
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
    return _plan_graph(graph, modules, quantizable)


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


def _float_type(module: nn.Module | None) -> type | None:
    """The torch.nn layer class of a (QAT) layer: a subclass of ``nn.Conv2d`` counts as ``nn.Conv2d``."""
    kind = module.float_type if isinstance(module, QATModule) else type(module) if module is not None else None
    return next((c for c in NORMS if kind is not None and issubclass(kind, c)), kind)


def _plan_graph(graph: torch.fx.Graph, modules: dict[str, nn.Module],
                quantizable: set[str]) -> tuple[list[_Plan], list[str]]:
    """The fusion plans of the layers named in ``quantizable`` (float or QAT modules), and the ReLU modules
    that alone follow a residual addition, from a symbolic or a recorded trace."""
    calls = Counter(n.target for n in graph.nodes if n.op == "call_module")

    def module_of(node: torch.fx.Node) -> nn.Module | None:
        return modules.get(node.target) if node.op == "call_module" else None

    plans: dict[torch.fx.Node, _Plan] = {}
    ends: dict[torch.fx.Node, _Plan] = {}
    tables = []
    for node in graph.nodes:
        layer = module_of(node)
        if layer is None or node.target not in quantizable or calls[node.target] != 1:
            continue
        if is_table(layer) or isinstance(layer, QATEmbedding):
            tables.append(_Plan(node.target, quantize_input=False))
            continue
        plan = _Plan(node.target)
        end = node
        nxt = _only_user(node)
        kind = _float_type(layer)
        folded_act = None
        if kind in NORMS and nxt is not None and nxt.op == "call_module" and calls[nxt.target] == 1 \
                and len(nxt.args) == 1 and isinstance(module_of(nxt), NORMS[kind]):
            folded_act = "bn" if type(module_of(nxt)) is NORMS[kind] else norm_activation(module_of(nxt))
        if folded_act == "bn":
            plan.bn, end, nxt = nxt.target, nxt, _only_user(nxt)
        elif folded_act is not None:  # a BatchNorm with its own activation: both fold, nothing follows to fuse
            plan.bn, end = nxt.target, nxt
            plan.activation = None if folded_act == "none" else folded_act
            plans[node] = plan
            ends[end] = plan
            continue
        activation = clamping_activation(nxt, module_of(nxt)) if nxt is not None and nxt.args \
            and nxt.args[0] is end else None
        if activation is not None:
            plan.activation, end = activation, nxt
            # a shared module or a function stays (idempotent on the clamped output); a module called once goes
            plan.fused_module = nxt.target if nxt.op == "call_module" and calls[nxt.target] == 1 else None
        plans[node] = plan
        ends[end] = plan
    fused_relus = {p.fused_module for p in plans.values() if p.fused_module is not None}
    residual_relus = []
    for node in graph.nodes:
        if _is_residual_add(node):
            relu = _only_user(node)
            if relu is not None and type(module_of(relu)) is nn.ReLU and calls[relu.target] == 1 \
                    and relu.target not in fused_relus:
                residual_relus.append(relu.target)
                ends[relu] = None
    for node, plan in plans.items():
        plan.quantize_input = not (node.args and _reaches(node.args[0], set(ends), modules))
    return tables + list(plans.values()), residual_relus


def _only_user(node: torch.fx.Node) -> torch.fx.Node | None:
    users = list(node.users)
    return users[0] if len(users) == 1 else None


def _is_residual_add(node: torch.fx.Node) -> bool:
    return _is_binary(node, ADDS)


def _is_binary(node: torch.fx.Node, functions: set) -> bool:
    """``node`` is one of ``functions`` applied to two tensors the model computed (not an input, not a constant)."""
    return node.op == "call_function" and node.target in functions and len(node.args) == 2 \
        and all(isinstance(a, torch.fx.Node) and a.op != "placeholder" for a in node.args)


_SITE_WORDS = {"add": "residual add", "mul": "product", "sigmoid": "sigmoid", "silu": "SiLU", "cat": "concatenation",
               "pool": "average pool", "norm": "BatchNorm"}


def _site_kind(node: torch.fx.Node, modules: dict[str, nn.Module]) -> str | None:
    """What a call site's observer would quantize: ``"add"`` / ``"mul"`` (of two computed tensors), ``"cat"`` (of
    several), ``"pool"`` (an average pool), ``"norm"`` (a BatchNorm not folded), ``"sigmoid"``, ``"silu"``, or
    ``"clamp"`` (a ReLU / ReLU6 after one of the first two); None for any other call."""
    module = modules.get(node.target) if node.op == "call_module" else None
    if _is_binary(node, ADDS):
        return "add"
    if _is_binary(node, MULS):
        return "mul"
    if isinstance(module, AVG_POOLS) or (node.op == "call_function" and node.target in AVG_POOL_FUNCTIONS):
        return "pool"
    if isinstance(module, nn.modules.batchnorm._BatchNorm):
        return "norm"  # one not folded into a conv before it: a pre-activation BatchNorm
    if node.op == "call_function" and node.target in CATS and node.args and isinstance(node.args[0], (list, tuple)) \
            and len(node.args[0]) > 1:
        return "cat"
    function = node.target if node.op == "call_function" else None
    if type(module) is nn.Sigmoid or function is torch.sigmoid:
        return "sigmoid"
    if is_silu_module(module) or function is F.silu:
        return "silu"
    return "clamp" if clamping_activation(node, module) is not None else None


def _reaches(node: object, quantized: set, modules: dict[str, nn.Module]) -> bool:
    """``node`` is one of ``quantized``, or reads one through quantization-preserving ops only."""
    while isinstance(node, torch.fx.Node):
        if node in quantized:
            return True
        module = modules.get(node.target) if node.op == "call_module" else None
        if not preserves_quantization(node, module) or not node.args:
            return False
        node = node.args[0]
    return False


def _plan_sites(graph: torch.fx.Graph, modules: dict[str, nn.Module]) -> tuple[list[torch.fx.Node], set]:
    """The nodes of the recorded trace whose call site needs its own observer, and every node whose output is
    then quantized.

    - A residual add or a product whose operands are both quantized gets one: on its output, or on the ReLU /
      ReLU6 that alone reads it (the runtime adds or multiplies in int8 and clamps on the integers).
    - So does a BatchNorm of a quantized tensor that no conv before it took in (DenseNet's pre-activation), on its
      output or on the ReLU that alone reads it: the converter runs it as a depthwise 1x1 QLinearConv.
    - So does an average pool of a quantized tensor (the runtime pools the integers and rounds the mean to the
      grid the QAT model rounded it to; a pool the model returns stays float).
    - So does a concatenation of quantized tensors (the runtime joins them on one grid, and a channel split or
      shuffle after it moves integers).
    - So does a sigmoid or a SiLU whose input is quantized (a SiLU's site also quantizes its sigmoid:
      :class:`SiLUFakeQuantize`), unless the model returns it: squeeze-excitation and SiLU then run on the integers.
    """
    quantized = set()
    for node in graph.nodes:
        module = modules.get(node.target) if node.op == "call_module" else None
        fq = getattr(module, "activation_post_process", None)
        if isinstance(fq, ActivationFakeQuantize) and fq.active and not isinstance(module, QATEmbedding):
            quantized.add(node)
    strangers: dict[str, set[str]] = {}  # module -> the modules it calls that are not its own children
    children: dict[str, set[str]] = {}
    for caller, called in getattr(graph, "module_calls", ()):
        if caller not in children:
            prefix = caller + "." if caller else ""
            children[caller] = {prefix + path for path, _ in own_children(modules[caller])}
        if called not in children[caller]:
            strangers.setdefault(caller, set()).add(called)
    sites = []
    for node in graph.nodes:
        kind = _site_kind(node, modules)
        if kind in (None, "clamp") or "site" not in node.meta:
            continue
        operands = node.args if kind in ("add", "mul") else node.args[0] if kind == "cat" else node.args[:1]
        if not operands or not all(_reaches(a, quantized, modules) for a in operands):
            continue
        user = _only_user(node)
        module = modules.get(user.target) if user is not None and user.op == "call_module" else None
        if isinstance(module, QuantizedReLU):
            continue  # the fx plan quantizes this sum already
        if kind == "pool" and _read_only_by_layers(node, modules):
            continue  # the layer's own input quantizer quantizes it (GAP -> flatten -> classifier), as before
        if kind in ("sigmoid", "silu", "pool") and any(u.op == "output" for u in node.users):
            continue  # a probability or feature the model returns keeps its float precision
        if kind in ("add", "mul", "norm") and user is not None and user.args and user.args[0] is node \
                and "site" in user.meta and clamping_activation(user, module) is not None:
            node = user
        if node.op != "call_module" and node.meta["site"][0] in strangers:
            warnings.warn(f"QAT: the {_SITE_WORDS[kind]} in {node.meta['site'][0]!r} stays float: that module calls "
                          f"modules that are not its own children ({', '.join(sorted(strangers[node.meta['site'][0]])[:3])}"
                          "), so its own calls cannot be counted apart from theirs", QATPlanWarning, stacklevel=2)
            continue
        sites.append(node)
        quantized.add(node)
    return sites, quantized


def _read_only_by_layers(node: torch.fx.Node, modules: dict[str, nn.Module]) -> bool:
    """Every path from ``node`` through quantization-preserving ops ends at a QAT layer's input."""
    stack, seen = list(node.users), set()
    while stack:
        user = stack.pop()
        if user in seen:
            continue
        seen.add(user)
        module = modules.get(user.target) if user.op == "call_module" else None
        if isinstance(module, QATModule):
            continue
        if user.op == "output" or not preserves_quantization(user, module):
            return False
        stack.extend(user.users)
    return True


def _unread_linears(graph: torch.fx.Graph, modules: dict[str, nn.Module], sites: set) -> list[QATLinear]:
    """The QAT linears with an output observer whose output no quantized layer or quantized add reads (through
    quantization-preserving ops)."""
    read = set()
    for node in graph.nodes:
        module = modules.get(node.target) if node.op == "call_module" else None
        if isinstance(module, QATModule) and not isinstance(module, QATEmbedding):
            sources = node.args[:1]
        elif _site_kind(node, modules) in ("add", "mul") and (node in sites or any(u in sites for u in node.users)):
            sources = node.args
        elif node in sites:  # a sigmoid or a SiLU
            sources = node.args[:1]
        else:
            continue
        for arg in sources:
            while isinstance(arg, torch.fx.Node):
                read.add(arg)
                inner = modules.get(arg.target) if arg.op == "call_module" else None
                if not preserves_quantization(arg, inner) or not arg.args:
                    break
                arg = arg.args[0]
    linears = []
    for node in graph.nodes:
        layer = modules.get(node.target) if node.op == "call_module" else None
        if isinstance(layer, QATLinear) and node not in read and layer.activation_post_process is not None:
            linears.append(layer)
    return linears
