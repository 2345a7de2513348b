"""A ``torch.fx`` graph of one real forward, and the call sites it names.

Symbolic tracing fails on models that branch on shapes or config (every Hugging Face model does). Running the
model once records what actually ran: each call of a *leaf* module (no children, or a QAT module) and each
torch function a non-leaf module's forward calls itself, with the call that produced each tensor argument.
The result is an ordinary ``torch.fx.Graph``, so one planner reads both kinds of trace.

Every recorded node carries its call site in ``node.meta["site"]``: ``(owner path, op, k)`` for a function (the
k-th call of that op by that module's own forward in one forward pass of the root), ``(module path, "forward",
k)`` for a module; ``graph.module_calls`` lists which module called which. :mod:`recal_torch.qat.sites` counts
the same way while training, so it can put a quantizer on exactly one call's output.
"""

from __future__ import annotations

import contextlib
import functools
import operator
from collections import Counter

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

Tensor = torch.Tensor
# every form of an add and of a ReLU: operator, function, method, in place (fx writes the first ones as targets)
ADDS = {operator.add, torch.add, Tensor.add, Tensor.add_, Tensor.__add__, Tensor.__iadd__, Tensor.__radd__}
MULS = {operator.mul, torch.mul, Tensor.mul, Tensor.mul_, Tensor.__mul__, Tensor.__imul__, Tensor.__rmul__}
RELUS = {torch.relu, torch.relu_, F.relu, Tensor.relu, Tensor.relu_}
SIGMOIDS = {torch.sigmoid, torch.sigmoid_, F.sigmoid, Tensor.sigmoid, Tensor.sigmoid_}
_CANONICAL = {**{f: operator.add for f in ADDS}, **{f: operator.mul for f in MULS}, **{f: F.relu for f in RELUS},
              **{f: torch.sigmoid for f in SIGMOIDS}}
_NAMES = {operator.add: "add", operator.mul: "mul"}


def op_name(func) -> str:
    """The name call sites count a function under: in-place and method forms count as their function."""
    canonical = _CANONICAL.get(func, func)
    return _NAMES.get(canonical) or getattr(canonical, "__name__", str(canonical))


class CallSites:
    """Which of ``root``'s modules is running, and how often each call site has run in this forward."""

    def __init__(self, root: nn.Module, is_leaf):
        self.paths = {id(m): n for n, m in root.named_modules()}
        self.leaves = {id(m) for m in root.modules() if is_leaf(m)}
        self.stack: list[nn.Module] = []
        self.entered: list[tuple[str, str, int] | None] = []
        self.counts: Counter = Counter()
        self.calls: list[tuple[str, str]] = []  # (caller's path, called module's path) of every counted call

    def owner(self) -> str | None:
        """The path of the module whose own forward is running (None inside a leaf or outside ``root``). A module
        that is not one of ``root``'s (``nn.ReLU()(x)`` written in a forward) runs as part of its caller's code."""
        for module in reversed(self.stack):
            if id(module) in self.paths:
                return None if id(module) in self.leaves else self.paths[id(module)]
        return None

    def count(self, scope: str, op: str) -> tuple[str, str, int]:
        key = (scope, op)
        k = self.counts[key]
        self.counts[key] = k + 1
        return scope, op, k

    def push(self, module: nn.Module) -> tuple[str, str, int] | None:
        """Enter ``module``; its call site when its caller is a non-leaf module of ``root``."""
        site = None
        if id(module) in self.paths and (not self.stack or self.owner() is not None):
            site = self.count(self.paths[id(module)], "forward")
            if self.stack:
                self.calls.append((self.owner(), site[0]))
        self.stack.append(module)
        self.entered.append(site)
        return site

    def pop(self, module: nn.Module) -> tuple[str, str, int] | None:
        """Leave ``module``; the call site :meth:`push` gave it."""
        while self.stack:  # (an exception may have skipped inner pops)
            site = self.entered.pop()
            if self.stack.pop() is module:
                return site
        return None


class _Recorder(TorchFunctionMode):
    def __init__(self, sites: CallSites):
        super().__init__()
        self.sites = sites
        self.graph = torch.fx.Graph()
        self.producer: dict[int, torch.fx.Node] = {}
        self.alive: list[object] = []  # every tensor seen, held so no id is reused while recording
        self.constants = 0

    def node_of(self, value):
        if isinstance(value, Tensor):
            node = self.producer.get(id(value))
            if node is None:  # a parameter, buffer or constant: a node, but from nothing recorded
                node = self.graph.placeholder(f"const_{self.constants}")
                self.constants += 1
                self._bind(value, node)
            return node
        if isinstance(value, (list, tuple)):
            return type(value)(self.node_of(v) for v in value)
        return value

    def _bind(self, value, node: torch.fx.Node) -> None:
        self.alive.append(value)
        self.producer[id(value)] = node

    def bind_outputs(self, out, node: torch.fx.Node) -> None:
        if isinstance(out, Tensor):
            self._bind(out, node)
        elif isinstance(out, (list, tuple)):
            for i, v in enumerate(out):
                if isinstance(v, Tensor):
                    item = self.graph.call_function(operator.getitem, (node, i))
                    self._bind(v, item)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        owner = self.sites.owner()
        if owner is None or not holds_tensor(out):
            return out
        site = self.sites.count(owner, op_name(func))
        canonical = _CANONICAL.get(func, func)
        node_args, node_kwargs = self.node_of(tuple(args)), {k: self.node_of(v) for k, v in kwargs.items()}
        name = getattr(func, "__name__", "")
        if canonical is func and getattr(Tensor, name, None) is func:  # a Tensor method
            node = self.graph.call_method(name, node_args, node_kwargs)
        else:
            node = self.graph.call_function(canonical, node_args, node_kwargs)
        node.meta["site"] = site
        self.bind_outputs(out, node)
        return out


def own_children(module: nn.Module, prefix: str = ""):
    """``(path, child)`` of the modules ``module``'s forward calls as its own: its children, and the items of its
    ``ModuleList`` / ``ModuleDict`` children (containers are never called themselves)."""
    for name, child in module.named_children():
        path = f"{prefix}.{name}" if prefix else name
        if isinstance(child, (nn.ModuleList, nn.ModuleDict)):
            yield from own_children(child, path)
        else:
            yield path, child


def holds_tensor(value) -> bool:
    return isinstance(value, Tensor) or (isinstance(value, (list, tuple)) and any(isinstance(v, Tensor) for v in value))


def record_forward(root: nn.Module, args: tuple, kwargs: dict, is_leaf) -> torch.fx.Graph:
    """The graph of ``root(*args, **kwargs)`` as it runs (in eval mode, without gradients; the training flags
    and the outputs are left as they were)."""
    sites = CallSites(root, is_leaf)
    recorder = _Recorder(sites)

    def before(module, inputs):
        site = sites.push(module)
        if site is not None and id(module) in sites.leaves:
            # a leaf called by a non-leaf module of root: one node; what runs inside it is not recorded
            node = recorder.graph.call_module(site[0], recorder.node_of(tuple(inputs)))
            node.meta["site"] = site
            module.__dict__["_recal_recording"] = node

    def after(module, inputs, out):
        node = module.__dict__.pop("_recal_recording", None)
        sites.pop(module)
        if node is not None:
            recorder.bind_outputs(out, node)

    handles = [nn.modules.module.register_module_forward_pre_hook(before),
               nn.modules.module.register_module_forward_hook(after, always_call=True)]
    eager = getattr(torch.compiler, "set_stance", None)  # torch.compile'd submodules run as plain code here
    try:
        with evaluating(root), (eager("force_eager") if eager else contextlib.nullcontext()), recorder:
            for i, value in enumerate([*args, *kwargs.values()]):
                if isinstance(value, Tensor):
                    recorder._bind(value, recorder.graph.placeholder(f"input_{i}"))
            sites.push(root)
            try:
                out = root.forward(*args, **kwargs)
            finally:
                sites.pop(root)
            recorder.graph.output(recorder.node_of(out) if holds_tensor(out) else None)
    finally:
        for h in handles:
            h.remove()
    recorder.graph.module_calls = sites.calls
    return recorder.graph


@contextlib.contextmanager
def evaluating(root: nn.Module):
    """``root`` in eval mode without gradients; every module's training flag restored after."""
    training = {m: m.training for m in root.modules()}
    root.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        for m, flag in training.items():
            m.training = flag



def mode_during_forward(module: nn.Module, mode_type: type[TorchFunctionMode]) -> None:
    """While ``module`` runs forward, ``mode_type(module)`` is entered (by a pre-hook) and left (by a forward hook
    that runs even when the forward raises). The hooks are plain functions and the modes live in the module's
    ``__dict__``, so a deep copy of the model (export) carries its own."""
    module.register_forward_pre_hook(functools.partial(_enter_mode, mode_type))
    module.register_forward_hook(functools.partial(_leave_mode, mode_type), always_call=True)


def active_modes(module: nn.Module, mode_type: type[TorchFunctionMode]) -> list[TorchFunctionMode]:
    """The ``mode_type`` modes ``module``'s running forwards entered (innermost last)."""
    return module.__dict__.setdefault("_recal_modes", {}).setdefault(mode_type.__name__, [])


def _enter_mode(mode_type, module: nn.Module, args) -> None:
    mode = mode_type(module)
    mode.__enter__()
    active_modes(module, mode_type).append(mode)


def _leave_mode(mode_type, module: nn.Module, args, output=None) -> None:
    modes = active_modes(module, mode_type)
    if modes:  # (empty when an earlier pre-hook raised before ours ran: let that error through)
        modes.pop().__exit__(None, None, None)
