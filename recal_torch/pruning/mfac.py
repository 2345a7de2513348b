"""The M-FAC pruning step (Frantar, Kurtic and Alistarh, 2021) for MFACPruningModifier.

Each layer's flattened weight is cut into blocks of ``B = fisher_block_size``. Per block the last ``m``
gradients ``g_j`` define the damped empirical Fisher ``F = damp * I + (1/m) sum g_j g_j^T``, which is
never formed: with ``G`` the ``m x B`` matrix of rows ``g_j / sqrt(m)``, the Woodbury identity gives

    F^-1 = (I - U^T U) / damp,   U = L^-1 G,   L L^T = damp * I_m + G G^T   (a Cholesky factor),

so ``diag(F^-1) = (1 - sum_j U_j^2) / damp`` and ``F^-1 x = (x - U^T (U x)) / damp`` cost ``m`` values per
weight (memory ``m`` times the layer's size, whatever the block size). At an update step:

- weight ``i`` costs ``w_i^2 / (2 [F^-1]_ii)`` to remove; the least costly go (one ranking across the
  layers with ``global_sparsity``), to the exact count the schedule asks for;
- the kept weights of each block take the joint OBS update for the removed set ``P``,
  ``delta = -H[:, P] (H_PP)^-1 w_P`` with ``H = F^-1``. ``H_PP = (I - U_P^T U_P) / damp`` is inverted by
  Woodbury too, in ``m x m``, so the update is exact with no ``B x B`` matrix. (Summing the single-weight
  updates instead, the paper's cheaper rule, overshoots when many correlated weights go at once: on a
  least-squares test it did worse than magnitude pruning.) With the same gradients, masks and updates
  equal OBSPruningModifier's; what differs is memory.

With no gradient collected (an update at step 0), ``F^-1 = I / damp`` and this is magnitude pruning.
"""

from __future__ import annotations

import torch

from recal_core import modifiers as M

from .obs import choose_least_costly


class GradientWindow:
    """The last ``size`` gradients of one parameter, in blocks of ``block`` weights."""

    def __init__(self, numel: int, block: int, size: int, device: torch.device):
        self.numel, self.block = numel, min(block, numel)
        self.blocks = -(-numel // self.block)
        self.grads = torch.zeros(size, self.blocks * self.block, device=device)
        self.count = 0  # gradients added since the last reset (the window keeps the newest ``size``)

    def add(self, grad: torch.Tensor) -> None:
        self.grads[self.count % self.grads.shape[0], : self.numel] = grad.detach().flatten().float()
        self.count += 1

    def factors(self, damp: float) -> torch.Tensor:
        """``U = L^-1 G`` per block, ``[blocks, m, B]`` in float64 (``m = 0`` when no gradient was added)."""
        m = min(self.count, self.grads.shape[0])
        # float64: diag(F^-1) is 1 - sum U^2 over damp, a difference that cancels in float32
        g = self.grads[:m].double().view(m, self.blocks, self.block).transpose(0, 1) / max(m, 1) ** 0.5
        if m == 0:
            return g  # [blocks, 0, B]
        gram = g @ g.transpose(1, 2) + damp * torch.eye(m, device=g.device, dtype=g.dtype)
        return torch.linalg.solve_triangular(torch.linalg.cholesky(gram), g, upper=False)

    def reset(self) -> None:
        self.grads.zero_()
        self.count = 0


def _padded(weight: torch.Tensor, size: int) -> torch.Tensor:
    flat = torch.zeros(size, device=weight.device)
    flat[: weight.numel()] = weight.detach().flatten().float()
    return flat


@torch.no_grad()
def mfac_step(weights: dict[str, torch.Tensor], windows: dict[str, GradientWindow], m: M.MFACPruningModifier,
              zeros: dict[str, int] | int) -> dict[str, torch.Tensor]:
    """Prune and update ``weights`` in place, removing ``zeros`` weights (per layer, or in total across them);
    return each layer's new mask."""
    costs, diags, factors = {}, {}, {}
    for name, w in weights.items():
        window = windows[name]
        u = window.factors(m.damp)  # [blocks, m, B]
        diag = (1.0 - u.square().sum(dim=1)) / m.damp  # [blocks, B]
        wb = _padded(w, window.blocks * window.block).view(window.blocks, window.block).double()
        cost = wb.square() / (2.0 * diag)
        cost.view(-1)[w.numel():] = float("inf")  # padding is never chosen
        costs[name], diags[name], factors[name] = cost, diag, u
    removed = choose_least_costly(costs, zeros)
    masks = {}
    for name, w in weights.items():
        window, u, gone = windows[name], factors[name], removed[name]
        wb = _padded(w, window.blocks * window.block).view(window.blocks, window.block).double()
        drop = gone.double()
        # per block, H_PP z = w_P with H_PP = (I - U_P^T U_P) / damp, inverted by Woodbury in m x m:
        # z = damp (w_P + U_P^T (I_m - U_P U_P^T)^-1 U_P w_P); then delta = -H z = -(z - U^T U z) / damp
        u_p = u * drop.unsqueeze(1)
        w_p = wb * drop
        inner = torch.eye(u.shape[1], dtype=u.dtype) - u_p @ u_p.transpose(1, 2)
        t = torch.linalg.solve(inner, torch.einsum("bmi,bi->bm", u_p, w_p)) if u.shape[1] else None
        z = w_p + (torch.einsum("bmi,bm->bi", u_p, t) if t is not None else 0.0)  # z / damp
        delta = z - torch.einsum("bmi,bm->bi", u, torch.einsum("bmi,bi->bm", u, z))
        keep = 1.0 - drop
        new = ((wb - delta) * keep).flatten()[: w.numel()].view_as(w)
        w.copy_(new.to(w.dtype))
        masks[name] = keep.flatten()[: w.numel()].view_as(w).to(w.dtype)
    return masks
