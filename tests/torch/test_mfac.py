"""MFACPruningModifier in PyTorch: the matrix-free inverse Fisher is the exact one, pruning without
gradients is magnitude pruning, M-FAC loses less than magnitude pruning on a quadratic, and training
holds the schedule's exact counts."""

import pytest
import torch

from recal_core import load_recipe
from recal_torch import ScheduledModifierManager
from recal_torch.pruning.mfac import GradientWindow, mfac_step
from recal_torch.pruning import magnitude_mask

from tests.torch.test_obs import _example_gradients, _fit, _loss, _problem, _two_layers, _zeros_after_each_step

MFAC = """
- !MFACPruningModifier {{params: {params}, init_sparsity: 0.5, final_sparsity: 0.5, start_epoch: {start},
                        end_epoch: 3, update_frequency: 1, num_grads: {m}, fisher_block_size: {block},
                        damp: {damp}, global_sparsity: {glob}, available_gpus: ["cuda:0"]}}
- !EpochRangeModifier {{start_epoch: 0, end_epoch: 4}}
"""


def _modifier(**kw):
    args = dict(params="[fc]", start=1, m=32, block=16, damp=1e-3, glob="false") | kw
    return load_recipe(MFAC.format(**args)).modifiers[0]


def test_matrix_free_inverse_equals_the_dense_inverse():
    torch.manual_seed(0)
    numel, block, m, damp = 40, 16, 7, 1e-2  # 3 blocks, the last one padded
    window = GradientWindow(numel, block, m, torch.device("cpu"))
    grads = [torch.randn(numel) for _ in range(m + 3)]  # more than the window: only the last m count
    for g in grads:
        window.add(g)
    u = window.factors(damp)
    kept = torch.stack(grads[-m:]).double()
    padded = torch.zeros(m, 48, dtype=torch.float64)
    padded[:, :numel] = kept
    for b in range(3):
        g = padded[:, b * block:(b + 1) * block]
        inverse = torch.linalg.inv(damp * torch.eye(block, dtype=torch.float64) + g.T @ g / m)
        assert torch.allclose((1 - u[b].square().sum(0)) / damp, inverse.diagonal(), rtol=1e-6)
        x = torch.randn(block, dtype=torch.float64)
        assert torch.allclose((x - u[b].T @ (u[b] @ x)) / damp, inverse @ x, rtol=1e-6, atol=1e-9)


def test_without_gradients_mfac_is_magnitude_pruning():
    torch.manual_seed(0)
    w = torch.randn(4, 16)
    expected = magnitude_mask(w, 32)
    pruned = w.clone()
    masks = mfac_step({"fc.weight": pruned}, {"fc.weight": GradientWindow(64, 16, 8, w.device)},
                      _modifier(start=0), {"fc.weight": 32})
    assert torch.equal(masks["fc.weight"], expected) and torch.equal(pruned, w * expected)


def test_mfac_loses_less_than_magnitude_pruning_on_a_quadratic():
    x, y = _problem()
    mfac_model, mag_model = _fit(x, y), _fit(x, y)
    w = mfac_model.fc.weight
    window = GradientWindow(w.numel(), 32, 512, w.device)  # one block, every example's gradient
    _example_gradients(mfac_model, x, y, window)
    masks = mfac_step({"fc.weight": w.data}, {"fc.weight": window}, _modifier(damp=1e-7), {"fc.weight": 16})
    assert int((masks["fc.weight"] == 0).sum()) == 16 and int((w == 0).sum()) == 16
    with torch.no_grad():
        mag_model.fc.weight.mul_(magnitude_mask(mag_model.fc.weight, 16))
    base = _loss(_fit(x, y), x, y)
    mfac, magnitude = _loss(mfac_model, x, y) - base, _loss(mag_model, x, y) - base
    print(f"damage M-FAC {mfac:.3f}, magnitude {magnitude:.3f}")
    assert mfac < 0.85 * magnitude


@pytest.mark.parametrize("glob", ["true", "false"])
def test_mfac_in_training_holds_exact_counts(glob):
    model = _two_layers()
    manager = ScheduledModifierManager.from_yaml(MFAC.format(params="[fc, out]", start=1, m=6, block=20,
                                                             damp=1e-5, glob=glob))
    with pytest.warns(UserWarning, match=r"<string>:4:\d+: !MFACPruningModifier .*available_gpus is not used"):
        optimizer = manager.modify(model, torch.optim.SGD(model.parameters(), lr=0.01), steps_per_epoch=8)
    for step, zeros in _zeros_after_each_step(model, optimizer):
        assert (zeros == [64, 16]) if glob == "false" else (sum(zeros) == 80), (step, zeros)
    windows = [w for ws in manager.masks.fishers.values() for w in ws.values()]
    assert windows and all(isinstance(w, GradientWindow) and w.count == 0 for w in windows)


def test_mfac_equals_obs_on_the_same_gradients():
    """Same Fisher, same ranking, same joint update: M-FAC's differs from OBS's only in memory."""
    from recal_core.modifiers import OBSPruningModifier
    from recal_torch.pruning.obs import FisherBlocks, obs_step

    torch.manual_seed(0)
    w = torch.randn(6, 10)  # 60 weights: blocks of 16, the last padded
    window, fisher = GradientWindow(60, 16, 9, w.device), FisherBlocks(60, 16, w.device)
    for _ in range(9):
        g = torch.randn(60)
        window.add(g)
        fisher.add(g)
    obs = OBSPruningModifier(params=["fc"], init_sparsity=0.3, final_sparsity=0.3, start_epoch=0, end_epoch=1,
                             update_frequency=1, damp=1e-3)
    a, b = w.clone(), w.clone()
    mask_m = mfac_step({"w": a}, {"w": window}, _modifier(damp=1e-3), {"w": 25})
    mask_o = obs_step({"w": b}, {"w": fisher}, obs, {"w": 25})
    assert torch.equal(mask_m["w"], mask_o["w"]) and int((mask_m["w"] == 0).sum()) == 25
    assert torch.allclose(a, b, atol=1e-4) and not torch.allclose(a, w * mask_m["w"])


def test_curvature_beyond_the_memory_limit_is_refused_before_allocation(monkeypatch):
    from recal_core import RecipeError
    from recal_torch import modify_checks

    monkeypatch.setattr(modify_checks, "MAX_CURVATURE_BYTES", 1000)
    model = _two_layers()  # fc: 128 weights x 32 gradients x 4 bytes = 16 KB
    manager = ScheduledModifierManager.from_yaml(MFAC.format(params="[fc]", start=1, m=32, block=16, damp=1e-5,
                                                             glob="false"))
    with pytest.raises(RecipeError, match=r"<string>:3:\d+: .*field 'num_grads': its curvature would hold 0.0 MiB for 1 layers"):
        manager.modify(model, torch.optim.SGD(model.parameters(), lr=0.1), steps_per_epoch=4)
