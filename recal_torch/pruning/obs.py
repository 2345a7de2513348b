"""The Optimal BERT Surgeon step (Kurtic et al., 2022, after Hassibi and Stork's OBS) for OBSPruningModifier.

Each layer's flattened weight is cut into blocks of ``B = fisher_block_size``; the empirical Fisher of
the last ``num_grads`` training gradients is kept per block, ``F_b = damp * I + (1/m) sum g_b g_b^T``, so
memory is ``B`` times the layer's size, never the layer squared. At an update step, with
``H = F_b^-1``:

- a group ``Q`` (one weight, or a block of 4 with ``mask_type: block4``) costs
  ``rho_Q = w_Q^T (H_QQ)^-1 w_Q / 2`` to remove (``w_i^2 / (2 H_ii)`` for one weight);
- the groups of least cost go (one ranking across the layers with ``global_sparsity``), to the exact
  zero count the schedule asks for;
- the kept weights of each block take the joint OBS update for all the weights ``P`` it removes,
  ``delta = -H[:, P] (H_PP)^-1 w_P`` (exact for the block's quadratic model), so the loss barely changes.

With no gradient collected yet (an update at step 0), ``H = I / damp`` and this is magnitude pruning.
"""

from __future__ import annotations

import torch

from recal_core import modifiers as M
from recal_core.model_plan import second_order_group


class FisherBlocks:
    """The block-diagonal empirical Fisher of one parameter, accumulated gradient by gradient."""

    def __init__(self, numel: int, block: int, device: torch.device):
        self.numel, self.block = numel, block
        self.blocks = -(-numel // block)
        self.sum = torch.zeros(self.blocks, block, block, device=device)
        self.count = 0

    def add(self, grad: torch.Tensor) -> None:
        g = torch.zeros(self.blocks * self.block, device=grad.device)
        g[: self.numel] = grad.detach().flatten().float()
        g = g.view(self.blocks, self.block)
        self.sum.baddbmm_(g.unsqueeze(2), g.unsqueeze(1))
        self.count += 1

    def inverse(self, damp: float) -> torch.Tensor:
        eye = torch.eye(self.block, device=self.sum.device)
        fisher = self.sum / max(self.count, 1) + damp * eye
        return torch.linalg.inv(fisher)

    def reset(self) -> None:
        self.sum.zero_()
        self.count = 0


def _padded(weight: torch.Tensor, blocks: int, block: int) -> torch.Tensor:
    flat = torch.zeros(blocks * block, device=weight.device)
    flat[: weight.numel()] = weight.detach().flatten().float()
    return flat.view(blocks, block)


@torch.no_grad()
def obs_step(weights: dict[str, torch.Tensor], fishers: dict[str, FisherBlocks], m: M.OBSPruningModifier,
             zeros: dict[str, int] | int) -> dict[str, torch.Tensor]:
    """Prune and update ``weights`` in place, removing ``zeros`` groups (per layer, or in total across them:
    :meth:`recal_core.model_plan.ModelPlan.second_order_updates`); return each layer's new mask."""
    group = second_order_group(m)
    costs, inverses, values = {}, {}, {}
    for name, w in weights.items():
        fisher = fishers[name]
        h = fisher.inverse(m.damp)  # [blocks, B, B]
        wb = _padded(w, fisher.blocks, fisher.block)  # [blocks, B]
        groups = fisher.block // group
        hq = h.view(fisher.blocks, groups, group, groups, group).diagonal(dim1=1, dim2=3).permute(0, 3, 1, 2)
        hq_inv = torch.linalg.inv(hq)  # [blocks, groups, Q, Q]
        wq = wb.view(fisher.blocks, groups, group)
        cost = 0.5 * torch.einsum("bgi,bgij,bgj->bg", wq, hq_inv, wq)
        valid = torch.arange(fisher.blocks * fisher.block, device=w.device).view(fisher.blocks, groups, group)[..., 0]
        cost = torch.where(valid < w.numel(), cost, torch.full_like(cost, float("inf")))  # padding is never chosen
        costs[name], inverses[name], values[name] = cost, (h, hq_inv), wq
    removed = choose_least_costly(costs, zeros)
    masks = {}
    for name, w in weights.items():
        fisher = fishers[name]
        h, hq_inv = inverses[name]
        gone = removed[name]  # [blocks, groups] bool
        keep = (~gone).repeat_interleave(group, dim=1).float()  # [blocks, B]
        wb = _padded(w, fisher.blocks, fisher.block)
        # per block, H_PP z = w_P on the removed positions P (identity rows elsewhere), then delta = -H[:, P] z_P
        drop = 1.0 - keep
        eye = torch.eye(fisher.block, device=w.device)
        system = h * drop.unsqueeze(2) * drop.unsqueeze(1) + eye * keep.unsqueeze(1)
        z = torch.linalg.solve(system, (wb * drop).unsqueeze(-1)).squeeze(-1) * drop
        new = wb - torch.einsum("bij,bj->bi", h, z)
        new = (new * keep).flatten()[: w.numel()].view_as(w)
        w.copy_(new.to(w.dtype))
        masks[name] = keep.flatten()[: w.numel()].view_as(w).to(w.dtype)
    return masks


def choose_least_costly(costs: dict[str, torch.Tensor], zeros: dict[str, int] | int) -> dict[str, torch.Tensor]:
    """The groups to remove: the least costly, per layer or across all (ties by position)."""
    removed = {}
    if isinstance(zeros, int):
        flat = torch.cat([c.flatten() for c in costs.values()])
        count = zeros
        gone = torch.zeros(flat.numel(), dtype=torch.bool, device=flat.device)
        gone[torch.argsort(flat, stable=True)[:count]] = True
        start = 0
        for name, c in costs.items():
            removed[name] = gone[start:start + c.numel()].view_as(c)
            start += c.numel()
        return removed
    for name, c in costs.items():
        gone = torch.zeros(c.numel(), dtype=torch.bool, device=c.device)
        gone[torch.argsort(c.flatten(), stable=True)[:zeros[name]]] = True
        removed[name] = gone.view_as(c)
    return removed
