"""Loading a thinned model's weights into the model as defined (full width): each thinned layer is cut to the
checkpoint's shapes first, and only where thinning could have made them, so a wrong checkpoint is refused."""

from __future__ import annotations


import torch
from torch import nn



from .thin import count_attributes, stores_inputs_first


@torch.no_grad()
def load_thinned(model: nn.Module, state_dict: dict[str, torch.Tensor]) -> None:
    """Load a thinned model's weights into ``model`` built dense (from the same config, or the same code):
    every layer whose weights are smaller in ``state_dict`` is resized to them first, and each attention's
    head counts follow its query projection. Strict: a name or shape that still differs is an error.

    Args:
        model: the model as built before thinning (a Hugging Face model from its config: ``from_pretrained``
            cannot rebuild per-layer sizes).
        state_dict: the thinned model's ``state_dict()`` (``save_pretrained``'s safetensors, loaded).
    """
    _check_thinning_only(model, state_dict)  # before anything changes
    changed: list[tuple[nn.Module, str, object]] = []  # (module, attribute, value before): undone on a refusal

    def change(m: nn.Module, attr: str, value) -> None:
        changed.append((m, attr, getattr(m, attr)))
        setattr(m, attr, value)

    try:
        for name, m in model.named_modules():
            prefix = f"{name}." if name else ""
            for attr in ("weight", "bias", "running_mean", "running_var"):
                t, new = getattr(m, attr, None), state_dict.get(prefix + attr)
                if isinstance(t, torch.Tensor) and isinstance(new, torch.Tensor) and t.shape != new.shape:
                    empty = torch.empty(new.shape, dtype=t.dtype, device=t.device)
                    change(m, attr, nn.Parameter(empty, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter)
                           else empty)
            weight = getattr(m, "weight", None)
            if isinstance(weight, torch.Tensor) and weight.dim() >= 2:
                out, into = (1, 0) if stores_inputs_first(m) else (0, 1)
                for attr, axis in (("out_features", out), ("out_channels", out), ("nf", out), ("in_features", into),
                                   ("in_channels", into), ("nx", into)):
                    if isinstance(getattr(m, attr, None), int):
                        change(m, attr, weight.shape[axis] * (getattr(m, "groups", 1) if attr == "in_channels" else 1))
                if getattr(m, "groups", 1) > 1 and weight.shape[1] == 1:  # depthwise: one filter per channel
                    change(m, "groups", weight.shape[0])
                    change(m, "in_channels", weight.shape[0])
            elif isinstance(weight, torch.Tensor) and isinstance(getattr(m, "num_features", None), int):
                change(m, "num_features", weight.shape[0])
        for name, m in model.named_modules():
            try:
                counts = _head_counts(m)
            except ValueError as exc:
                raise ValueError(f"load_thinned: {name} ({type(m).__name__}): {exc}") from None
            for attr, value in counts:
                change(m, attr, value)
        _check_loads_whole(model, state_dict)  # load_state_dict copies what fits before it refuses the rest
        model.load_state_dict(state_dict)
    except BaseException:  # all or nothing: the model as it was built, its tensors untouched
        for m, attr, value in reversed(changed):
            setattr(m, attr, value)
        raise


THINNED_AXES = {"weight": (0, 1), "bias": (0,), "running_mean": (0,), "running_var": (0,)}


def _check_thinning_only(model: nn.Module, state_dict: dict[str, torch.Tensor]) -> None:
    """Every tensor whose shape differs from the dense model's is that tensor thinned: the same rank, smaller only
    along the axes thinning removes (a weight's output and input channels, a bias's or a norm's one axis), never
    larger, so nothing bigger than the dense model is ever allocated. Raises ValueError naming the layer and axis."""
    for name, m in model.named_modules():
        prefix = f"{name}." if name else ""
        for attr, axes in THINNED_AXES.items():
            t, new = getattr(m, attr, None), state_dict.get(prefix + attr)
            if not isinstance(t, torch.Tensor) or not isinstance(new, torch.Tensor) or t.shape == new.shape:
                continue
            where = f"{prefix + attr} ({type(m).__name__})"
            if new.dim() != t.dim():
                raise ValueError(f"load_thinned: {where} has rank {new.dim()} in the state dict, {t.dim()} in the "
                                 "model: thinning removes channels, it does not reshape")
            for axis, (was, now) in enumerate(zip(t.shape, new.shape)):
                if now > was:
                    raise ValueError(f"load_thinned: {where} is larger along axis {axis} in the state dict ({now}) "
                                     f"than in the model ({was}): thinning only removes")
                if now != was and axis not in axes:
                    raise ValueError(f"load_thinned: {where} differs along axis {axis} ({was} -> {now}), which "
                                     f"thinning does not remove (it removes along axes {list(axes)})")


def _check_loads_whole(model: nn.Module, state_dict: dict[str, torch.Tensor]) -> None:
    """Every name of the resized model's state dict in ``state_dict`` with its shape, and no other name: else a
    ValueError naming them (``load_state_dict`` would have copied the tensors that fit before refusing)."""
    own = model.state_dict()
    missing, extra = sorted(own.keys() - state_dict.keys()), sorted(state_dict.keys() - own.keys())
    if missing or extra:
        raise ValueError(f"load_thinned: the state dict does not fit the model (missing {missing[:3]}, unexpected "
                         f"{extra[:3]}); nothing was loaded")
    for key, tensor in own.items():
        new = state_dict[key]
        if not isinstance(new, torch.Tensor) or new.shape != tensor.shape:
            got = tuple(new.shape) if isinstance(new, torch.Tensor) else type(new).__name__
            raise ValueError(f"load_thinned: {key} is {got} in the state dict, {tuple(tensor.shape)} in the thinned "
                             "model; nothing was loaded")


def _head_counts(m: nn.Module) -> list[tuple[str, int]]:
    """An attention module's head counts from its (resized) projections, where it keeps them as attributes:
    ``(attribute, value)`` pairs that differ from what it holds."""
    head_dim = next((getattr(m, a) for a in ("attention_head_size", "head_dim")
                     if isinstance(getattr(m, a, None), int)), None)
    children = dict(m.named_children())
    query = next((children[n] for n in ("query", "q_proj") if n in children), None)
    key = next((children[n] for n in ("key", "k_proj") if n in children), None)
    fused = children.get("query_key_value")  # Falcon: each key/value head's queries, key and value together
    if head_dim is not None and fused is not None and isinstance(getattr(m, "num_heads", None), int):
        kv = getattr(m, "num_kv_heads", m.num_heads)
        per_unit = m.num_heads // kv
        units = fused.weight.shape[0] // ((per_unit + 2) * head_dim)
        return count_attributes(m, units * per_unit, units, head_dim, m.num_heads)
    packed = children.get("c_attn")  # GPT-2: Q, K and V in one Conv1D, split by split_size
    if head_dim is not None and packed is not None and isinstance(getattr(m, "split_size", None), int) \
            and not getattr(m, "is_cross_attention", False):
        heads = packed.weight.shape[-1 if stores_inputs_first(packed) else 0] // 3 // head_dim
        return count_attributes(m, heads, heads, head_dim, m.split_size // head_dim)
    if head_dim is None or not isinstance(query, nn.Linear):
        return []
    return count_attributes(m, query.out_features // head_dim,
                             key.out_features // head_dim if isinstance(key, nn.Linear) else None, head_dim)
