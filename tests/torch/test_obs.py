"""OBSPruningModifier in PyTorch: exact counts, magnitude pruning without curvature, and a smaller loss
increase than magnitude pruning where the Fisher is the loss's curvature (least squares)."""

import pytest
import torch
from torch import nn

from recal_core import load_recipe
from recal_torch import ScheduledModifierManager
from recal_torch.pruning.obs import FisherBlocks, obs_step
from recal_torch.pruning import magnitude_mask

OBS = """
- !OBSPruningModifier {{params: [fc], init_sparsity: 0.5, final_sparsity: 0.5, start_epoch: {start}, end_epoch: 3,
                       update_frequency: 1, num_grads: 32, fisher_block_size: 16, damp: {damp}, mask_type: {mask},
                       global_sparsity: {glob}, grad_sampler_kwargs: {{batch_size: 8}}}}
- !EpochRangeModifier {{start_epoch: 0, end_epoch: 4}}
"""


def _problem(seed=0, n=512, d=32):
    """Least squares with correlated features: the loss is quadratic, its Hessian the features' covariance."""
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(d, d, generator=g)
    x = torch.randn(n, d, generator=g) @ mix / d ** 0.5
    w_true = torch.randn(1, d, generator=g)
    return x, x @ w_true.T + 0.5 * torch.randn(n, 1, generator=g)  # noise: per-batch gradients at the optimum


def _fit(x, y):
    model = nn.Sequential()
    model.fc = nn.Linear(x.shape[1], 1, bias=False)
    with torch.no_grad():
        model.fc.weight.copy_(torch.linalg.lstsq(x, y).solution.T)
    return model


def _loss(model, x, y):
    return nn.functional.mse_loss(model(x), y).item()


def _example_gradients(model, x, y, curvature):
    """Add each example's gradient of the least-squares loss to ``curvature``: the empirical Fisher."""
    for i in range(len(x)):
        model.zero_grad()
        nn.functional.mse_loss(model(x[i:i + 1]), y[i:i + 1]).backward()
        curvature.add(model.fc.weight.grad)


def _two_layers():
    torch.manual_seed(0)
    model = nn.Sequential()
    model.fc = nn.Linear(16, 8)
    model.out = nn.Linear(8, 4)
    return model


def _zeros_after_each_step(model, optimizer, steps=32, first=8):
    """Train ``steps`` steps; from step ``first`` (the first update) on, yield the zeros of fc and out."""
    for step in range(steps):
        optimizer.zero_grad()
        model.out(torch.relu(model.fc(torch.randn(8, 16)))).pow(2).mean().backward()
        optimizer.step()
        if step + 1 >= first:
            yield step, [int((p == 0).sum()) for p in (model.fc.weight, model.out.weight)]


@pytest.mark.parametrize("mask", ["unstructured", "block4"])
def test_obs_loses_less_than_magnitude_pruning_on_a_quadratic(mask):
    x, y = _problem()
    obs_model, mag_model = _fit(x, y), _fit(x, y)
    w = obs_model.fc.weight
    fisher = FisherBlocks(w.numel(), 32, w.device)  # one block: the Fisher is the features' covariance
    _example_gradients(obs_model, x, y, fisher)
    m = load_recipe(OBS.format(start=1, damp=1e-7, mask=mask, glob="false")).modifiers[0]
    masks = obs_step({"fc.weight": w.data}, {"fc.weight": fisher}, m, {"fc.weight": 16 // (4 if mask == "block4" else 1)})
    assert int((masks["fc.weight"] == 0).sum()) == 16 and int((w == 0).sum()) == 16
    with torch.no_grad():
        if mask == "block4":  # the same structure, ranked by magnitude
            from recal_core.mask_layout import mask_layout
            from recal_torch.pruning import structured_mask

            layout = mask_layout((1, 4), (1, 32))
            mag_model.fc.weight.mul_(structured_mask(mag_model.fc.weight, layout, 4, (0, 1)))
        else:
            mag_model.fc.weight.mul_(magnitude_mask(mag_model.fc.weight, 16))
    base = _loss(_fit(x, y), x, y)
    obs, magnitude = _loss(obs_model, x, y) - base, _loss(mag_model, x, y) - base
    # with the exact curvature the OBS update is the least-squares refit on the kept weights; the empirical
    # Fisher of 512 example gradients estimates that curvature, so its result comes close to the refit
    kept = masks["fc.weight"][0] != 0
    refit = nn.functional.mse_loss(x[:, kept] @ torch.linalg.lstsq(x[:, kept], y).solution, y).item() - base
    print(f"{mask}: damage OBS {obs:.3f}, magnitude {magnitude:.3f}, refit of OBS's choice {refit:.3f}")
    assert obs < 0.85 * magnitude and obs < 1.1 * refit


def test_without_gradients_obs_is_magnitude_pruning():
    torch.manual_seed(0)
    w = torch.randn(4, 16)
    m = load_recipe(OBS.format(start=0, damp=1e-3, mask="unstructured", glob="false")).modifiers[0]
    expected = magnitude_mask(w, 32)
    pruned = w.clone()
    masks = obs_step({"fc.weight": pruned}, {"fc.weight": FisherBlocks(64, 16, w.device)}, m, {"fc.weight": 32})
    assert torch.equal(masks["fc.weight"], expected) and torch.equal(pruned, w * expected)


@pytest.mark.parametrize("glob", ["true", "false"])
def test_obs_in_training_holds_exact_counts(glob):
    model = _two_layers()
    recipe = OBS.format(start=1, damp=1e-6, mask="block4", glob=glob).replace("params: [fc]", "params: [fc, out]")
    manager = ScheduledModifierManager.from_yaml(recipe)
    with pytest.warns(UserWarning, match=r"<string>:4:\d+: !OBSPruningModifier .*grad_sampler_kwargs is not used"):
        optimizer = manager.modify(model, torch.optim.SGD(model.parameters(), lr=0.01), steps_per_epoch=8)
    for step, zeros in _zeros_after_each_step(model, optimizer):  # half of the groups of 4 are gone
        if glob == "false":
            assert zeros == [64, 16], step
        else:
            assert sum(zeros) == 80 and all(z % 4 == 0 for z in zeros), step
    assert manager.masks.fishers and all(f.count == 0 for fs in manager.masks.fishers.values() for f in fs.values())
