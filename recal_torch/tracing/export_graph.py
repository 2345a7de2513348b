"""A model as the core's coupling ops and attentions, from a ``torch.export`` trace: for models ``torch.fx``
cannot trace symbolically (Hugging Face transformers), given example inputs.

The trace is ATen: ``linear`` (and FalconLinear's ``x @ W.T + b``) is a layer, zero-preserving elementwise ops
keep channels, a product or sum of two same-shaped tensors (a gated MLP) joins their channels, anything else
blocks them (:mod:`recal_core.channel_coupling`). Each attention (:mod:`~recal_torch.tracing.attention_sites`)
becomes an :class:`~recal_core.head_coupling.Attention`: the ``linear`` behind each of its query, key and value
inputs, the rows of it each head reads (:mod:`~recal_torch.tracing.head_rows`, read into a layout by
:func:`~recal_core.head_coupling.head_layout`), and the ``linear`` its merged output reaches; a tensor on the way
that something else also reads blocks it.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn

from recal_core.channel_coupling import ModelGraph, Op, channel_spaces
from recal_core.head_coupling import Attention

from .aten_nodes import (CONVS, ELEMENTWISE, FAKE_QUANTS, JOIN, PADS, SAME, TRANSPOSES, VIEWS, aten, bias_add_of,
                         is_spatial, is_tensor, matmul_on_weight, pads_only_space, position_of, projection_of,
                         same_shape, shape_of, where_of)
from .exported_attention import attention_of
from .attention_sites import attention_sites

SAME |= {aten.max_pool1d.default, aten.max_pool2d.default, aten.max_pool3d.default, aten.avg_pool1d.default,
          aten.avg_pool2d.default, aten.avg_pool3d.default, aten.adaptive_avg_pool1d.default,
          aten.adaptive_avg_pool2d.default, aten.adaptive_avg_pool3d.default, aten.adaptive_max_pool2d.default}
SAME |= FAKE_QUANTS


EXAMPLE_INPUTS = "_recal_example_inputs"  # where modify(..., example_inputs=) keeps them on the model


def remember_example_inputs(model: nn.Module, example_inputs: Any) -> None:
    """Keep ``example_inputs`` on ``model`` (a plain attribute, not state), so that ``thin`` and the channel and
    head graphs trace it with them later without being given them again."""
    if example_inputs is not None:
        model.__dict__[EXAMPLE_INPUTS] = example_inputs


def example_inputs_of(model: nn.Module) -> tuple[tuple, dict] | None:
    """Inputs to trace ``model`` with when the user gave none: those given to ``modify``; for a Hugging Face
    model, ``model.dummy_inputs``, one image of the config's size for vision models, or one silent clip of the
    config's length for Whisper. None when recal knows no way to feed it."""
    stored = model.__dict__.get(EXAMPLE_INPUTS)
    if stored is not None:
        return trace_args(model, stored)
    config = getattr(model, "config", None)
    name = getattr(model, "main_input_name", None)
    if config is None or name is None:
        return None
    if name == "pixel_values":
        size = getattr(config, "image_size", 224)
        size = tuple(size) if isinstance(size, (list, tuple)) else (size, size)
        device = next(model.parameters()).device
        return (), {name: torch.zeros(1, getattr(config, "num_channels", 3), *size, device=device)}
    if name == "input_features" and hasattr(config, "num_mel_bins") and hasattr(config, "max_source_positions"):
        device = next(model.parameters()).device  # Whisper: the encoder takes exactly 2 frames per position
        kwargs = {name: torch.zeros(1, config.num_mel_bins, 2 * config.max_source_positions, device=device)}
        if getattr(config, "decoder_start_token_id", None) is not None and hasattr(model, "get_decoder"):
            kwargs["decoder_input_ids"] = torch.full((1, 1), config.decoder_start_token_id, device=device)
        return (), {**kwargs, **({"use_cache": False} if getattr(config, "use_cache", False) else {})}
    dummy = getattr(model, "dummy_inputs", None)
    if isinstance(dummy, dict) and name in dummy:
        device = next(model.parameters()).device
        kwargs = {key: dummy[key][:1].to(device) for key in (name, "decoder_input_ids") if key in dummy}  # (T5's
        # decoder needs its own inputs)
        if getattr(config, "use_cache", False):
            kwargs["use_cache"] = False  # a key/value cache reads every head: trace the attention alone
        return (), kwargs
    return None


def exported_graph(model: nn.Module, example_inputs: Any = None) -> ModelGraph:
    """``model``'s channel spaces and attentions from a ``torch.export`` trace on ``example_inputs`` (a
    tensor, a tuple of positional inputs, or ``(args, kwargs)``; None: :func:`example_inputs_of`)."""
    args, kwargs = trace_args(model, example_inputs)
    was_training = model.training
    model.eval()  # dropout and batch statistics out of the trace; the ops' channels are the same
    try:
        program = torch.export.export(model, args, kwargs, strict=False)
    finally:
        model.train(was_training)
    ops, attentions = _ops(program)
    return ModelGraph(channel_spaces(ops), attentions)


def trace_args(model: nn.Module, example_inputs: Any) -> tuple[tuple, dict]:
    """``(args, kwargs)`` to call ``model`` with from ``example_inputs`` (None: :func:`example_inputs_of`)."""
    if example_inputs is None:
        found = example_inputs_of(model)
        if found is None:
            raise ValueError(f"torch.fx cannot trace this {type(model).__name__} and recal has no example inputs "
                             "for torch.export: pass example_inputs= (a batch of the model's inputs)")
        return found
    if isinstance(example_inputs, torch.Tensor):
        args, kwargs = (example_inputs,), {}
    elif isinstance(example_inputs, dict):
        args, kwargs = (), dict(example_inputs)
    elif isinstance(example_inputs, tuple) and len(example_inputs) == 2 and isinstance(example_inputs[1], dict) \
            and isinstance(example_inputs[0], (tuple, list)):
        args, kwargs = tuple(example_inputs[0]), dict(example_inputs[1])
    else:
        args, kwargs = tuple(example_inputs), {}
    return args, _without_cache(model, kwargs)


def _without_cache(model: nn.Module, kwargs: dict) -> dict:
    """``kwargs`` with ``use_cache=False`` for a model whose config caches keys and values (a Hugging Face decoder's
    default) unless the caller set it: the cache is no tensor ``torch.export`` can return, and reads every head."""
    if getattr(getattr(model, "config", None), "use_cache", False) is True and "use_cache" not in kwargs \
            and "use_cache" in inspect.signature(model.forward).parameters:
        return {**kwargs, "use_cache": False}
    return kwargs


def _ops(program: torch.export.ExportedProgram) -> tuple[list[Op], list[Attention]]:
    sig = program.graph_signature
    params = {**sig.inputs_to_parameters, **sig.inputs_to_buffers, **sig.inputs_to_lifted_tensor_constants}
    graph = program.graph
    constant = _constants(graph, params)
    lifted = {node: program.constants[name] for node, name in sig.inputs_to_lifted_tensor_constants.items()
              if isinstance(program.constants.get(name), torch.Tensor)}
    for node in graph.nodes:  # a QAT layer's weight, fake-quantized (and BatchNorm-scaled), is its parameter
        source = node.args[0] if node.target in FAKE_QUANTS else None
        if isinstance(source, torch.fx.Node) and source.target is aten.mul.Tensor and source.name not in params:
            weight = next((a for a in source.args if isinstance(a, torch.fx.Node) and a.name in params), None)
            if weight is not None and all(a.name in constant for a in source.all_input_nodes):
                params[source.name] = params[weight.name]  # conv weight x BatchNorm factor (a folded QAT conv)
        if isinstance(source, torch.fx.Node) and source.name in params:
            params[node.name] = params[source.name]
        source = node.args[0] if node.target in TRANSPOSES else None
        if isinstance(source, torch.fx.Node) and source.name in params and len(shape_of(node) or ()) == 2:
            params[node.name] = params[source.name]  # a weight transposed for x @ w.T
    for node in graph.nodes:  # a weight computed from one parameter of its shape and constants (a group-wise or
        if node.target is aten.linear.default or node.target in CONVS:  # learned-scale fake quantizer): that one
            weight = node.args[1]
            if isinstance(weight, torch.fx.Node) and weight.name not in params and weight.name in constant:
                source = _weight_source(weight, constant[weight.name], sig.inputs_to_parameters, graph)
                if source is not None:
                    params[weight.name] = source
    gates, inside = _self_gates(graph, params)
    ops: list[Op] = []
    for node in graph.nodes:
        tensors = tuple(a.name for a in node.all_input_nodes if a.name not in params)
        if node.name in params and node.op != "placeholder" or node in inside or \
                matmul_on_weight(node, params) and bias_add_of(node, params) is not None:
            continue  # a weight's fake quantizer (the weight itself); a gate's own ops (the gate is one op); a
            # matmul whose bias add is the layer
        if node in gates:
            ops.append(Op(where_of(node), "same", (gates[node].name,), node.name))
            continue
        if _flattens_for_conv1d(node, params):
            ops.append(Op(where_of(node), "same", tensors[:1], node.name))
            continue
        if _undoes_batchnorm_factor(node, constant):
            ops.append(Op(where_of(node), "same", (node.args[0].name,), node.name))
            continue
        if node.op == "placeholder":
            if node.name not in params:
                ops.append(Op(node.name, "input", (), node.name))
        elif node.op == "output":
            ops.append(Op("the model's output", "output", tensors))
        elif (projection := projection_of(node, params)) is not None:  # (a linear on a computed weight: "other")
            x, weight, bias = projection
            weight, bias = params[weight.name], params.get(bias.name) if isinstance(bias, torch.fx.Node) else None
            ops.append(Op(weight.rsplit(".", 1)[0], "layer", (x.name,), node.name, weight, bias))
        elif node.target in CONVS and node.args[1].name in params:
            ops.append(_conv(node, params, tensors))
        elif node.target is aten.batch_norm.default and node.args[1] is not None and node.args[3] is not None:
            weight, bias, mean = (params.get(a.name) if a is not None else None for a in node.args[1:4])
            ops.append(Op(weight.rsplit(".", 1)[0], "norm", tensors[:1], node.name, weight, bias, (mean,)))
        elif node.target is aten.flatten.using_ints and tuple(node.args[1:]) in ((1,), (1, -1)):
            ops.append(Op(where_of(node), "flatten", tensors, node.name))
        elif node.target is aten.mean.dim and len(tensors) == 1 and is_spatial(node):
            ops.append(Op(where_of(node), "same", tensors, node.name))  # a global average pool written out
        elif (node.target in SAME or (node.target in PADS and pads_only_space(node))) and len(tensors) == 1:
            ops.append(Op(where_of(node), "same", tensors, node.name))
        elif node.target in JOIN and len(tensors) == 2 and same_shape(node, *node.all_input_nodes):
            ops.append(Op(where_of(node), "add", tensors, node.name))
        elif node.target is aten.mul.Tensor and len(tensors) == 1 and not is_tensor(node.args[1 - position_of(node)]):
            ops.append(Op(where_of(node), "same", tensors, node.name))  # times a scalar
        elif node.op == "call_function":
            ops.append(Op(where_of(node), "other", tensors, node.name))
    order = {n: i for i, n in enumerate(graph.nodes)}  # (the ops on a projection's way, sorted as the graph runs)
    attentions = [attention_of(site, params, order, lifted) for site in attention_sites(graph, params)]
    return ops, attentions


def _flattens_for_conv1d(node: torch.fx.Node, params: dict[str, str]) -> bool:
    """A view that keeps the last axis (the channels) on the way into or out of a Conv1D's ``addmm``: the
    ``[-1, in]`` it multiplies, or the ``[..., out]`` it returns."""
    if node.target not in VIEWS or not isinstance(node.args[0], torch.fx.Node):
        return False
    into, out = shape_of(node.args[0]), shape_of(node)
    if not into or not out or into[-1] != out[-1]:
        return False
    users = list(node.users)
    return _is_conv1d(node.args[0], params) or len(users) == 1 and _is_conv1d(users[0], params) \
        and projection_of(users[0], params)[0] is node


def _is_conv1d(node: torch.fx.Node, params: dict[str, str]) -> bool:
    return node.target is aten.addmm.default and projection_of(node, params) is not None


def _self_gates(graph: torch.fx.Graph, params: dict[str, str]):
    """Products ``a * g`` where ``a`` is ``x`` or ``x`` times a number and ``g`` an elementwise function of ``x``
    alone (GELU's tanh and erf forms, SiLU written out): zero where ``x`` is, so one channel-keeping op from
    ``a``. Returns those products with their ``a``, and the ops computing the ``g``s (read by nothing else)."""
    gates: dict[torch.fx.Node, torch.fx.Node] = {}
    inside: set[torch.fx.Node] = set()
    for node in graph.nodes:
        if node.target is not aten.mul.Tensor or len(node.all_input_nodes) != 2 or \
                any(a.name in params for a in node.all_input_nodes):
            continue
        for a, g in (node.args[:2], node.args[1::-1]):
            if not isinstance(a, torch.fx.Node) or not isinstance(g, torch.fx.Node):
                continue
            root = a.args[0] if a.target is aten.mul.Tensor and len(a.all_input_nodes) == 1 \
                and isinstance(a.args[0], torch.fx.Node) else a
            ops = _function_of(g, root)
            if ops and all(set(n.users) <= ops | {node} for n in ops):
                gates[node] = a
                inside |= ops
                break
    return gates, inside


def _function_of(node: torch.fx.Node, root: torch.fx.Node) -> set[torch.fx.Node] | None:
    """The elementwise ops that compute ``node`` from ``root`` and numbers alone (None if anything else feeds
    it, or it is ``root`` itself)."""
    ops: set[torch.fx.Node] = set()
    stack = [node]
    while stack:
        n = stack.pop()
        if n is root or n in ops:
            continue
        if n.op != "call_function" or n.target not in ELEMENTWISE or len(ops) >= 32 or \
                not all(isinstance(a, (torch.fx.Node, int, float)) for a in n.args) or n.kwargs:
            return None  # (a gate is a few ops: a residual stream of adds is not walked to its start)
        ops.add(n)
        stack.extend(n.all_input_nodes)
    return ops or None


def _constants(graph: torch.fx.Graph, params: dict[str, str]) -> dict[str, frozenset[str]]:
    """Every parameter, buffer and value computed from them alone (not from an input), by name: the parameters
    and buffers it is computed from."""
    constant = {name: frozenset((name,)) for name in params}
    for node in graph.nodes:  # (a tensor made from literals alone, a quantizer's zeros, is from none of them)
        if node.op == "call_function" and all(a.name in constant for a in node.all_input_nodes):
            constant[node.name] = frozenset().union(*(constant[a.name] for a in node.all_input_nodes))
    return constant


def _weight_source(weight: torch.fx.Node, sources: frozenset[str], parameters: dict[str, str],
                   graph: torch.fx.Graph) -> str | None:
    """The one parameter among ``sources`` with ``weight``'s shape (or, a Conv1D's, its transpose): the weight a
    fake quantizer computed from it and its scales."""
    shape = shape_of(weight)
    if shape is None:
        return None
    placeholders = {n.name: n for n in graph.nodes if n.op == "placeholder"}
    found = {parameters[s] for s in sources if s in parameters and s in placeholders
             and shape_of(placeholders[s]) in (shape, shape[::-1])}
    return found.pop() if len(found) == 1 else None


def _undoes_batchnorm_factor(node: torch.fx.Node, constant: dict[str, frozenset[str]]) -> bool:
    """A folded QAT conv's ``conv / factor`` before its BatchNorm, the factor computed from that BatchNorm's own
    tensors alone: it scales each channel (zeros stay zeros), and thinning slices the BatchNorm, so the factor."""
    if node.target is not aten.div.Tensor or len(node.args) != 2 or not isinstance(node.args[1], torch.fx.Node):
        return False
    x, factor = node.args
    users = list(node.users)
    if not isinstance(x, torch.fx.Node) or x.name in constant or factor.name not in constant or len(users) != 1 \
            or users[0].target is not aten.batch_norm.default:
        return False
    norm = {a.name for a in users[0].all_input_nodes[1:]}
    return bool(constant[factor.name]) and constant[factor.name] <= norm


def _conv(node: torch.fx.Node, params: dict[str, str], tensors: tuple[str, ...]) -> Op:
    weight = params[node.args[1].name]
    bias = params.get(node.args[2].name) if len(node.args) > 2 and node.args[2] is not None else None
    groups = node.args[6] if len(node.args) > 6 else node.kwargs.get("groups", 1)
    shape = shape_of(node.args[1])
    name = weight.rsplit(".", 1)[0]
    if groups == 1:
        return Op(name, "layer", tensors[:1], node.name, weight, bias)
    if shape is not None and groups == shape[0] and shape[1] == 1:
        return Op(name, "depthwise", tensors[:1], node.name, weight, bias)
    return Op(f"{name} (grouped conv)", "other", tensors, node.name)


