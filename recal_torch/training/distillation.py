"""Knowledge distillation for the recipe's DistillationModifier: the teacher's softened outputs as a loss.

``loss = manager.loss(loss, inputs, student_outputs)`` in the training loop (SparseML called it
``loss_update``): while a DistillationModifier is in force the result is
``hardness * KD + (1 - hardness) * loss``, with ``KD = T**2 * KL(softmax(teacher / T) || softmax(student / T))``
averaged over the rows of each distilled output (the last axis holds the classes) and over the outputs
named in ``distill_output_keys`` (all of a model's outputs when it names none); otherwise ``loss`` as is.
Outputs may be tensors, tuples, dicts or Hugging Face ``ModelOutput``s.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from recal_core import modifiers as M


def _named_outputs(outputs: Any, keys: Sequence[str] | None, who: str) -> list[tuple[str, torch.Tensor]]:
    if isinstance(outputs, torch.Tensor):
        if keys:
            raise ValueError(f"the {who} returned a tensor, but distill_output_keys names {list(keys)}; "
                             "leave distill_output_keys out for a model with one output")
        return [("output", outputs)]
    if isinstance(outputs, Mapping):  # dicts and Hugging Face ModelOutputs
        wanted = list(keys) if keys else [k for k, v in outputs.items() if isinstance(v, torch.Tensor)]
        missing = [k for k in wanted if k not in outputs or not isinstance(outputs[k], torch.Tensor)]
        if missing:
            have = ", ".join(k for k, v in outputs.items() if isinstance(v, torch.Tensor))
            raise ValueError(f"the {who}'s outputs have no tensor {missing[0]!r} (distill_output_keys); it has: {have}")
        return [(k, outputs[k]) for k in wanted]
    if isinstance(outputs, (tuple, list)):
        if keys:
            raise ValueError(f"the {who} returned a {type(outputs).__name__}; distill_output_keys needs named "
                             "outputs (a dict or ModelOutput)")
        return [(str(i), t) for i, t in enumerate(outputs) if isinstance(t, torch.Tensor)]
    raise TypeError(f"the {who} returned a {type(outputs).__name__}, not tensors, a dict or a ModelOutput")


def distillation_loss(student: Any, teacher: Any, m: M.DistillationModifier) -> torch.Tensor:
    """The modifier's KD term for one batch (see the module docstring)."""
    s_named = _named_outputs(student, m.distill_output_keys, "student")
    t_named = dict(_named_outputs(teacher, m.distill_output_keys, "teacher"))
    terms = []
    for key, s in s_named:
        t = t_named.get(key)
        if t is None or t.shape != s.shape:
            got = "nothing" if t is None else f"shape {tuple(t.shape)}"
            raise ValueError(f"the teacher's output {key!r} is {got}, the student's has shape {tuple(s.shape)}; "
                             "distillation needs outputs of the same shape")
        temperature = m.temperature
        s2 = s.reshape(-1, s.shape[-1]).float() / temperature
        t2 = t.detach().reshape(-1, t.shape[-1]).float() / temperature
        if not bool(torch.isfinite(t2).all()):  # one value read back a step: a NaN loss would ruin every weight
            bad = int((~torch.isfinite(t2)).any(-1).sum())
            raise ValueError(f"the teacher's output {key!r} holds NaN or infinity ({bad} of {t2.shape[0]} rows of this "
                             "batch): distilling from it would make the student's loss, then its weights, NaN; check "
                             "the teacher (its dtype's range, its weights) on this batch")
        kl = F.kl_div(F.log_softmax(s2, -1), F.log_softmax(t2, -1), log_target=True, reduction="batchmean")
        terms.append(kl * temperature ** 2)
    return torch.stack(terms).mean()


class Teacher:
    """The teacher model: run in eval mode without gradients on the student's inputs."""

    def __init__(self, model: nn.Module):
        if not isinstance(model, nn.Module):
            raise TypeError(f"teacher must be a torch.nn.Module, not {type(model).__name__}")
        self.model = model.eval()
        for p in model.parameters():
            p.requires_grad_(False)

    @torch.no_grad()
    def __call__(self, inputs: Any) -> Any:
        if isinstance(inputs, Mapping):
            return self.model(**inputs)
        if isinstance(inputs, (tuple, list)):
            return self.model(*inputs)
        return self.model(inputs)
