"""The fusion plans read off a traced forward (``torch.fx``, or a recording of the first forward): which layer fuses
which BatchNorm and activation, which inputs are already quantized, which call sites get an observer."""

from __future__ import annotations

import logging
import warnings
from collections import Counter
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import QATPlanWarning
from .quantizers import ActivationFakeQuantize
from .layers import (NORMS, QATEmbedding, QATLinear, QATModule,
                     QuantizedReLU, is_table)
from .patterns import (AVG_POOL_FUNCTIONS, AVG_POOLS, CATS, clamping_activation, is_silu_module, norm_activation,
                       preserves_quantization)
from .trace import ADDS, MULS, own_children

log = logging.getLogger(__name__)



@dataclass
class FusionPlan:
    """One QAT layer: what it fuses, whether it quantizes its input, the activation clamped before its output."""

    target: str
    bn: str | None = None
    fused_module: str | None = None  # the activation module fused (it becomes nn.Identity)
    quantize_input: bool = True
    activation: str | None = None  # "relu" or "relu6": clamped before the output is quantized


def _float_type(module: nn.Module | None) -> type | None:
    """The torch.nn layer class of a (QAT) layer: a subclass of ``nn.Conv2d`` counts as ``nn.Conv2d``."""
    kind = module.float_type if isinstance(module, QATModule) else type(module) if module is not None else None
    return next((c for c in NORMS if kind is not None and issubclass(kind, c)), kind)


def plan_graph(graph: torch.fx.Graph, modules: dict[str, nn.Module],
                quantizable: set[str]) -> tuple[list[FusionPlan], list[str]]:
    """The fusion plans of the layers named in ``quantizable`` (float or QAT modules), and the ReLU modules
    that alone follow a residual addition, from a symbolic or a recorded trace."""
    calls = Counter(n.target for n in graph.nodes if n.op == "call_module")

    def module_of(node: torch.fx.Node) -> nn.Module | None:
        return modules.get(node.target) if node.op == "call_module" else None

    plans: dict[torch.fx.Node, FusionPlan] = {}
    ends: dict[torch.fx.Node, FusionPlan] = {}
    tables = []
    for node in graph.nodes:
        layer = module_of(node)
        if layer is None or node.target not in quantizable or calls[node.target] != 1:
            continue
        if is_table(layer) or isinstance(layer, QATEmbedding):
            tables.append(FusionPlan(node.target, quantize_input=False))
            continue
        plan = FusionPlan(node.target)
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
        plan.quantize_input = not (node.args and reaches(node.args[0], set(ends), modules))
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


def site_kind(node: torch.fx.Node, modules: dict[str, nn.Module]) -> str | None:
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


def reaches(node: object, quantized: set, modules: dict[str, nn.Module]) -> bool:
    """``node`` is one of ``quantized``, or reads one through quantization-preserving ops only."""
    while isinstance(node, torch.fx.Node):
        if node in quantized:
            return True
        module = modules.get(node.target) if node.op == "call_module" else None
        if not preserves_quantization(node, module) or not node.args:
            return False
        node = node.args[0]
    return False


def plan_sites(graph: torch.fx.Graph, modules: dict[str, nn.Module]) -> tuple[list[torch.fx.Node], set]:
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
        kind = site_kind(node, modules)
        if kind in (None, "clamp") or "site" not in node.meta:
            continue
        operands = node.args if kind in ("add", "mul") else node.args[0] if kind == "cat" else node.args[:1]
        if not operands or not all(reaches(a, quantized, modules) for a in operands):
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
            site = node.meta['site'][0]
            warnings.warn(f"QAT: the {_SITE_WORDS[kind]} in {site!r} stays float: that module calls "
                          f"modules that are not its own children ({', '.join(sorted(strangers[site])[:3])}"
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


def unread_linears(graph: torch.fx.Graph, modules: dict[str, nn.Module], sites: set) -> list[QATLinear]:
    """The QAT linears with an output observer whose output no quantized layer or quantized add reads (through
    quantization-preserving ops)."""
    read = set()
    for node in graph.nodes:
        module = modules.get(node.target) if node.op == "call_module" else None
        if isinstance(module, QATModule) and not isinstance(module, QATEmbedding):
            sources = node.args[:1]
        elif site_kind(node, modules) in ("add", "mul") and (node in sites or any(u in sites for u in node.users)):
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
