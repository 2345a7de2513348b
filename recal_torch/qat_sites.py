"""Quantizers on the outputs of single calls: a residual add, the ReLU after it, one call of a shared module.

Model code writes ``out = out + identity`` or ``self.relu(out)`` (the same ReLU module twice, as torchvision's
``BasicBlock`` does); no module owns those tensors, so no module swap can quantize them. The plan names each
such tensor by its call site (:mod:`recal_torch.qat_trace`): ``(owner path, op, k)``. While the model runs
forward, a ``TorchFunctionMode`` and module hooks count calls the same way and pass the output of each planned
call through its own observer. The observers live in ``root.recal_sites`` (a ``ModuleDict``), so checkpoints
carry them, and export writes each as QuantizeLinear/DequantizeLinear.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from .qat import ActivationFakeQuantize, device_of, is_leaf
from .qat_trace import CallSites, holds_tensor, op_name

CONTAINER = "recal_sites"
Site = tuple[str, str, int]


def site_key(site: Site) -> str:
    """The ``ModuleDict`` key of a call site (a module name may not hold a dot)."""
    scope, op, k = site
    return f"{scope.replace('.', '/')}:{op}:{k}"


def parse_key(key: str) -> Site:
    scope, op, k = key.rsplit(":", 2)
    return scope.replace("/", "."), op, int(k)


def install(root: nn.Module, sites: list[Site]) -> None:
    """Give each of ``sites`` its own observer and run them from now on."""
    container = root.__dict__["_modules"].get(CONTAINER)
    if container is None:
        container = nn.ModuleDict()
        root.add_module(CONTAINER, container)
    for site in sites:
        if site_key(site) not in container:
            container[site_key(site)] = ActivationFakeQuantize().to(device_of(root))
    if not root.__dict__.get("_recal_sites_hooked"):
        root.__dict__["_recal_sites_hooked"] = True
        root.register_forward_pre_hook(_enter)
        root.register_forward_hook(_leave, always_call=True)


def restore(root: nn.Module, state_dict, prefix: str, *args) -> None:
    """A load-state-dict pre-hook: the observers a checkpoint holds are created before it loads (the plan that
    made them comes at the first forward)."""
    head = prefix + CONTAINER + "."
    keys = sorted({k[len(head):].split(".")[0] for k in state_dict if k.startswith(head)})
    if keys:
        install(root, [parse_key(k) for k in keys])


class _Run:
    """One forward of ``root`` with its sites quantized."""

    def __init__(self, root: nn.Module):
        container = root.__dict__["_modules"][CONTAINER]
        self.quantizers = {parse_key(k): m for k, m in container.items()}
        self.sites = CallSites(root, is_leaf)
        self.mode = _SiteMode(self)
        self.handles = [nn.modules.module.register_module_forward_pre_hook(self.before),
                        nn.modules.module.register_module_forward_hook(self.after, always_call=True)]
        self.root = root
        self.sites.push(root)
        self.mode.__enter__()

    def before(self, module, inputs):
        self.sites.push(module)

    def after(self, module, inputs, out):
        site = self.sites.pop(module)
        quantizer = self.quantizers.get(site) if site is not None else None
        return quantizer(out) if quantizer is not None and isinstance(out, torch.Tensor) else None

    def close(self) -> None:
        self.mode.__exit__(None, None, None)
        for handle in self.handles:
            handle.remove()


class _SiteMode(TorchFunctionMode):
    def __init__(self, run: _Run):
        super().__init__()
        self.run = run

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        sites = self.run.sites
        owner = sites.owner()
        if owner is None or not holds_tensor(out):  # counted exactly as the recording counted
            return out
        quantizer = self.run.quantizers.get(sites.count(owner, op_name(func)))
        return quantizer(out) if quantizer is not None and isinstance(out, torch.Tensor) else out


def _enter(root: nn.Module, args) -> None:
    if CONTAINER in root.__dict__["_modules"]:
        root.__dict__.setdefault("_recal_site_runs", []).append(_Run(root))


def _leave(root: nn.Module, args, output=None) -> None:
    runs = root.__dict__.get("_recal_site_runs")
    if runs:  # (empty when an earlier pre-hook raised before ours ran: let that error through)
        runs.pop().close()
