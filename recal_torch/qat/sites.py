"""Quantizers on the outputs of single calls: a residual add, the ReLU after it, a product, a sigmoid, a SiLU, one
call of a shared module.

Model code writes ``out = out + identity`` or ``self.relu(out)`` (the same ReLU module twice, as torchvision's
``BasicBlock`` does); no module owns those tensors, so no module swap can quantize them. The plan names each
such tensor by its call site (:mod:`recal_torch.qat.trace`): ``(owner path, op, k)``. While the model runs
forward, hooks count calls the same way and pass the output of each planned call through its own observer:
a forward hook on a module with a planned call; for a function, a ``TorchFunctionMode`` entered only while the
module that calls it runs its own code (hooks on its children pause the count). Nothing else is hooked, so a
model pays only where it has sites. The observers live in ``root.recal_sites`` (a ``ModuleDict``), so checkpoints
carry them, and export writes each as QuantizeLinear/DequantizeLinear. A SiLU's site gets a
:class:`~recal_torch.qat.SiLUFakeQuantize`, which recomputes the call from its input with its sigmoid quantized too.
"""

from __future__ import annotations

from collections import Counter

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from .quantizers import ActivationFakeQuantize, SiLUFakeQuantize
from .layers import device_of
from .patterns import is_silu_module
from .trace import active_modes, holds_tensor, mode_during_forward, op_name, own_children

CONTAINER = "recal_sites"
Site = tuple[str, str, int]


def site_key(site: Site) -> str:
    """The ``ModuleDict`` key of a call site (a module name may not hold a dot)."""
    scope, op, k = site
    return f"{scope.replace('.', '/')}:{op}:{k}"


def parse_key(key: str) -> Site:
    scope, op, k = key.rsplit(":", 2)
    return scope.replace("/", "."), op, int(k)


class SiteObservers(nn.ModuleDict):
    """The call sites' observers, one child of the model's root (so checkpoints carry them). Called, it passes its
    input through: an ``nn.Sequential`` root calls every child in turn, this one last."""

    def forward(self, *args):
        return args[0] if len(args) == 1 else args


def install(root: nn.Module, sites: list[Site]) -> None:
    """Give each of ``sites`` its own observer and run them from now on."""
    container = root.__dict__["_modules"].get(CONTAINER)
    if container is None:
        container = SiteObservers()
        root.add_module(CONTAINER, container)
    for site in sites:
        if site_key(site) not in container:
            quantizer = SiLUFakeQuantize() if _is_silu(root, site) else ActivationFakeQuantize()
            container[site_key(site)] = quantizer.to(device_of(root))
    if not root.__dict__.get("_recal_sites_hooked"):
        root.__dict__["_recal_sites_hooked"] = True
        root.register_forward_pre_hook(_new_forward)
    for site in map(parse_key, container):
        scope, op, _ = site
        module = root.get_submodule(scope)
        hooks = module.__dict__.setdefault("_recal_site_hooks", set())
        if op in hooks:
            continue
        hooks.add(op)
        # plain entries in __dict__ (not submodules): the state dict is unchanged, a deep copy follows them
        module.__dict__["_recal_site_root"], module.__dict__["_recal_site_path"] = root, scope
        if op == "forward":
            if isinstance(module, nn.SiLU):
                module.inplace = False  # its site recomputes the call from the input: keep the input as it was
            module.register_forward_hook(_module_call, prepend=True)  # before a parent's _leave_child: still paused
        elif len(hooks - {"forward"}) == 1:  # the first function site of this module
            mode_during_forward(module, _OwnCode)
            for _, child in own_children(module):
                child.__dict__.setdefault("_recal_site_parents", []).append(module)
                if len(child.__dict__["_recal_site_parents"]) == 1:
                    child.register_forward_pre_hook(_enter_child)
                    child.register_forward_hook(_leave_child, always_call=True)


def restore(root: nn.Module, state_dict, prefix: str, *args) -> None:
    """A load-state-dict pre-hook: the observers a checkpoint holds are created before it loads (the plan that
    made them comes at the first forward)."""
    head = prefix + CONTAINER + "."
    keys = sorted({k[len(head):].split(".")[0] for k in state_dict if k.startswith(head)})
    if keys:
        install(root, [parse_key(k) for k in keys])


def _is_silu(root: nn.Module, site: Site) -> bool:
    scope, op, _ = site
    return op == "silu" or (op == "forward" and is_silu_module(root.get_submodule(scope)))


def _quantized(quantizer: nn.Module | None, args: tuple, out):
    """The planned call's output through its quantizer (None when it has none): a SiLU's is recomputed from its
    input."""
    if quantizer is None or not isinstance(out, torch.Tensor):
        return None
    return quantizer(args[0]) if getattr(quantizer, "reads_input", False) else quantizer(out)


def _new_forward(root: nn.Module, args) -> None:
    root.__dict__["_recal_site_forward"] = root.__dict__.get("_recal_site_forward", 0) + 1


def _next(module: nn.Module, op: str) -> nn.Module | None:
    """The observer of the k-th call of ``op`` by ``module`` in this forward of its root (None if unplanned)."""
    root = module.__dict__["_recal_site_root"]
    forward = root.__dict__.get("_recal_site_forward", 0)
    if module.__dict__.get("_recal_site_seen") != forward:
        module.__dict__["_recal_site_seen"], module.__dict__["_recal_site_counts"] = forward, Counter()
    counts = module.__dict__["_recal_site_counts"]
    site = (module.__dict__["_recal_site_path"], op, counts[op])
    counts[op] += 1
    return root.__dict__["_modules"][CONTAINER]._modules.get(site_key(site))


def _module_call(module: nn.Module, args, out):
    return _quantized(_next(module, "forward"), args, out)


def adopt(old: nn.Module, new: nn.Module) -> None:
    """``new`` stands in for ``old`` (an export module for a QAT one): while it runs, its parents' own-code
    counting pauses as it did for ``old``, so the export counts the call sites as training did (a QAT conv's
    fused ReLU is not its parent's ReLU)."""
    parents = old.__dict__.get("_recal_site_parents")
    if parents:
        new.__dict__["_recal_site_parents"] = parents
        new.register_forward_pre_hook(_enter_child)
        new.register_forward_hook(_leave_child, always_call=True)


def _enter_child(child: nn.Module, args) -> None:
    for parent in child.__dict__["_recal_site_parents"]:
        for mode in active_modes(parent, _OwnCode):
            mode.inside += 1


def _leave_child(child: nn.Module, args, output=None) -> None:
    for parent in child.__dict__["_recal_site_parents"]:
        for mode in active_modes(parent, _OwnCode):
            mode.inside = max(0, mode.inside - 1)


class _OwnCode(TorchFunctionMode):
    """Counts the torch calls a module's own forward makes (not its children's) and quantizes planned ones."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module
        self.inside = 0  # > 0 while one of the module's children runs

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if op_name(func) == "silu" and kwargs.get("inplace"):
            kwargs = {**kwargs, "inplace": False}  # a planned SiLU is recomputed from its input: keep it as it was
        out = func(*args, **kwargs)
        if self.inside or not holds_tensor(out):  # counted exactly as the recording counted
            return out
        quantized = _quantized(_next(self.module, op_name(func)), tuple(args) or tuple(kwargs.values()), out)
        return out if quantized is None else quantized
