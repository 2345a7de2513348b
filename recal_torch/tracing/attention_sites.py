"""Where a traced model computes attention: each ``scaled_dot_product_attention``, and each
``softmax(q @ kᵀ) @ v`` written out (Hugging Face's eager attention, BLOOM's ``baddbmm`` with ALiBi, a user's
own attention code).

A written-out attention is found from its ``softmax`` over the last axis: above it, through a scale, a mask
and views of the scores, the one product of two computed tensors (``matmul``, ``bmm``, or ``baddbmm`` with a
bias), the queries and the keys transposed; below it, through dropout and casts, the product of the weights
with the values. What arrives there may have its heads merged into the batch (``[batch * heads, tokens, d]``),
which :mod:`~recal_torch.tracing.head_rows` reads.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_aten = torch.ops.aten
_SOFTMAX = {_aten.softmax.int, _aten._softmax.default, _aten._safe_softmax.default}
_PRODUCTS = {_aten.matmul.default, _aten.bmm.default}
# between the product of queries and keys and the softmax: scale, mask, bias, views, casts
_SCORE_OPS = {_aten.add.Tensor, _aten.sub.Tensor, _aten.mul.Tensor, _aten.div.Tensor, _aten.mul.Scalar,
              _aten.div.Scalar, _aten.add.Scalar, _aten.where.self, _aten.where.ScalarOther, _aten.masked_fill.Scalar,
              _aten.masked_fill.Tensor, _aten._to_copy.default, _aten.to.dtype, _aten.type_as.default,
              _aten.view.default, _aten.reshape.default, _aten._unsafe_view.default, _aten.clamp.default,
              _aten.tanh.default}
# between the softmax and the product with the values
_WEIGHT_OPS = {_aten.dropout.default, _aten._to_copy.default, _aten.to.dtype, _aten.type_as.default,
               _aten.view.default, _aten.reshape.default, _aten._unsafe_view.default, _aten.clone.default,
               _aten.contiguous.default, _aten.detach.default}
CHECKS = {_aten._assert_tensor_metadata.default}  # the exporter's own checks: read nothing into the model


@dataclass(frozen=True)
class Site:
    """One attention in a trace: the node that names it, its query, key and value tensors (the key as given:
    ``key_transposed`` when it is ``kᵀ``), and the node whose output holds the heads' results."""

    node: torch.fx.Node
    query: torch.fx.Node
    key: torch.fx.Node
    value: torch.fx.Node
    output: torch.fx.Node
    key_transposed: bool = False
    products: tuple[torch.fx.Node, ...] = ()  # the nodes reading the queries, keys and values (beside ``node``)


def attention_sites(graph: torch.fx.Graph, params: dict[str, str]) -> list[Site]:
    """Every attention in ``graph`` (``params``: the nodes that are weights, by name)."""
    out = []
    for node in graph.nodes:
        if node.target is _aten.scaled_dot_product_attention.default:
            out.append(Site(node, *node.args[:3], node))
        elif node.target in _SOFTMAX and _last_axis(node):
            site = _written_out(node, params)
            if site is not None:
                out.append(site)
    return out


def readers(node: torch.fx.Node) -> list[torch.fx.Node]:
    """The nodes that read ``node``'s values (not the exporter's shape checks)."""
    return [u for u in node.users if u.target not in CHECKS]


def _last_axis(softmax: torch.fx.Node) -> bool:
    dim = softmax.args[1] if len(softmax.args) > 1 else softmax.kwargs.get("dim")
    val = softmax.meta.get("val")
    return isinstance(dim, int) and isinstance(val, torch.Tensor) and dim % val.dim() == val.dim() - 1


def _written_out(softmax: torch.fx.Node, params: dict[str, str]) -> Site | None:
    scores, stack, seen = [], [(softmax.args[0], 0)], set()
    while stack:
        node, depth = stack.pop()
        if not isinstance(node, torch.fx.Node) or node in seen or depth > 8 or node.op != "call_function":
            continue
        seen.add(node)
        if node.target in _PRODUCTS and _computed(node.args[0], params) and _computed(node.args[1], params):
            scores.append((node.args[0], node.args[1], node))
        elif node.target is _aten.baddbmm.default and _computed(node.args[1], params) and \
                _computed(node.args[2], params):
            scores.append((node.args[1], node.args[2], node))
        elif node.target in _SCORE_OPS:
            stack.extend((a, depth + 1) for a in node.all_input_nodes)
    if len(scores) != 1:
        return None
    weights = softmax
    while True:
        users = readers(weights)
        if len(users) != 1:
            return None
        user = users[0]
        if user.target in _PRODUCTS and user.args[0] is weights and _computed(user.args[1], params):
            query, key, product = scores[0]
            return Site(softmax, query, key, user.args[1], user, key_transposed=True, products=(product, user))
        if user.target not in _WEIGHT_OPS:
            return None
        weights = user


def _computed(node, params: dict[str, str]) -> bool:
    """A tensor computed in the forward (not a weight, not a number)."""
    return isinstance(node, torch.fx.Node) and node.name not in params and node.op == "call_function"
