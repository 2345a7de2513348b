"""A recipe planned from measurement (issue 71): the search is exact, a budget it cannot meet names the nearest
one, and the plan is a recipe recal trains, giving bits where the loss needs them."""

import itertools

import numpy as np
import pytest
import torch
from torch import nn

from recal_core import load_recipe
from recal_core.precision_plan import FLOAT, Candidate, LayerCandidates, PlanError, size_bounds, solve


def _random_layers(rng, n):
    layers = []
    for i in range(n):
        params = int(rng.integers(100, 2000))
        scores = np.sort(rng.exponential(1.0, 3))[::-1]  # fewer bits, more loss
        layers.append(LayerCandidates(f"l{i}", params, (Candidate(FLOAT, 4 * params, 0.0),) + tuple(
            Candidate(b, params * b / 8, float(s)) for b, s in zip((2, 4, 8), scores))))
    return layers


def test_the_search_is_exact_against_every_plan():
    rng = np.random.default_rng(0)
    for _ in range(20):
        layers = _random_layers(rng, 4)
        low, high = size_bounds(layers)
        budget = float(rng.uniform(low, high))
        best = min((sum(c.score for c in combo), combo) for combo in itertools.product(*(layer.candidates for layer in layers))
                   if sum(c.cost for c in combo) <= budget)[0]
        choice = solve(layers, budget)
        assert sum(c.cost for c in choice.values()) <= budget + 1e-6
        assert sum(c.score for c in choice.values()) == pytest.approx(best, abs=1e-9)


def test_a_budget_below_every_plan_names_the_smallest():
    layers = _random_layers(np.random.default_rng(1), 3)
    smallest = size_bounds(layers)[0]
    with pytest.raises(PlanError, match=f"smallest plan, every layer at its fewest bits, is {smallest:,.0f} bytes"):
        solve(layers, smallest - 1)


BUDGET = 4.0  # bits per weight, scales counted: one of the two 64 x 64 layers may keep 4 bits, not both


def _net_and_data():
    """A small MLP trained on a rule, then made fragile in its second layer without changing what it computes."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8))
    x = torch.randn(512, 64)
    y = (x @ torch.randn(64, 8) + 2.0 * torch.randn(512, 8)).argmax(1)  # a noisy rule: the loss stays well above 0
    opt = torch.optim.Adam(net.parameters(), lr=3e-3)
    for _ in range(100):
        opt.zero_grad()
        nn.functional.cross_entropy(net(x), y).backward()
        opt.step()
    with torch.no_grad():  # the same function, one layer made fragile: outlier inputs a coarse grid cannot share
        net[2].weight[:, :4] *= 12.0  # (a ReLU passes a positive factor through: the first layer's rows shrink)
        net[0].weight[:4] /= 12.0
        net[0].bias[:4] /= 12.0
    batches = [(x[i:i + 128], y[i:i + 128]) for i in range(0, 512, 128)]
    return net, batches


@pytest.mark.parametrize("score", ["measured", "fisher"])
def test_the_plan_gives_bits_where_the_loss_needs_them_and_is_a_recipe_recal_trains(score):
    from recal_torch import ScheduledModifierManager
    from recal_torch.precision_plan import plan_precision

    net, batches = _net_and_data()
    loss = lambda m, b: nn.functional.cross_entropy(m(b[0]), b[1])  # noqa: E731
    before = [p.detach().clone() for p in net.parameters()]
    plan = plan_precision(net, batches, loss, bits_budget=BUDGET, score=score)
    assert all(torch.equal(a, b) for a, b in zip(before, net.parameters()))  # measuring leaves the model as it was
    bits = {name: c.bits for name, c in plan.choice.items()}
    assert bits["2"] > bits["0"], plan.recipe  # the fragile layer keeps more bits than a robust one of its size
    assert plan.size <= BUDGET / 8 * sum(layer.params for layer in plan.layers) + 4 * (64 + 64 + 8) + 1e-6
    recipe = load_recipe(plan.recipe)
    manager = ScheduledModifierManager(recipe)
    optimizer = manager.modify(net, torch.optim.SGD(net.parameters(), lr=1e-3), steps_per_epoch=2)
    for b in batches[:2]:
        optimizer.zero_grad()
        loss(net, b).backward()
        optimizer.step()
    manager.finalize(net)
    held = manager.quantized_layers
    for name, b in bits.items():
        if b == FLOAT:
            assert name not in held or "float" in held[name], held
        else:
            assert f"{b}" in held[name], (name, held[name])


def test_recal_plan_writes_the_recipe_the_api_plans_and_its_pareto_plot(tmp_path, monkeypatch):
    """``recal plan --model module:function --data calibration.npz --budget bits=4``: the same recipe as
    ``plan_precision`` on the same batches, one ``recal check`` reads, and the Pareto curve as a PNG; a budget no
    plan meets names the smallest, a latency budget says it is not measured, data without labels that are not
    token ids says what to give."""
    import numpy as np

    from recal_torch.precision_plan import plan_precision

    from tests.support.cli_in_process import run_recal

    net, batches = _net_and_data()
    torch.save(net.state_dict(), tmp_path / "net.pt")
    (tmp_path / "planmodels.py").write_text(
        "import torch\nfrom torch import nn\n\n\ndef build():\n"
        "    net = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8))\n"
        "    net.load_state_dict(torch.load('net.pt', weights_only=True))\n    return net\n")
    x, y = torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])
    np.savez(tmp_path / "calibration.npz", inputs=x.numpy(), labels=y.numpy())
    monkeypatch.chdir(tmp_path)
    args = ["plan", "--model", "planmodels:build", "--data", "calibration.npz", "--batch-size", "128",
            "--no-progress"]
    result = run_recal(*args, "--budget", "bits=4", "--output", "plan.yaml", "--plot", "pareto.png")
    assert result.returncode == 0, result.stderr
    loss = lambda m, b: nn.functional.cross_entropy(m(b[0]), b[1])  # noqa: E731
    assert (tmp_path / "plan.yaml").read_text() == plan_precision(net, batches, loss, bits_budget=4.0).recipe
    assert run_recal("check", "plan.yaml").returncode == 0
    assert (tmp_path / "pareto.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "planned 3 layers" in result.stdout and "wrote plan.yaml" in result.stdout
    refused = run_recal(*args, "--budget", "size=1kB", "--output", "small.yaml")
    assert refused.returncode == 2 and "the smallest plan, every layer at its fewest bits, is" in refused.stderr
    assert not (tmp_path / "small.yaml").exists()
    latency = run_recal(*args, "--budget", "latency=5ms")
    assert latency.returncode == 2 and "latency per layer is not measured yet" in latency.stderr
    (tmp_path / "kerasish.py").write_text("def build():\n    return {'layers': []}\n")
    other = run_recal("plan", "--model", "kerasish:build", *args[3:], "--budget", "bits=4")
    assert other.returncode == 2 and "not a torch.nn.Module (recal plan measures PyTorch models" in other.stderr
    np.savez(tmp_path / "unlabelled.npz", inputs=x.numpy())
    unlabelled = run_recal(*args[:4], "unlabelled.npz", "--budget", "bits=4")
    assert unlabelled.returncode == 2 and "give 'labels' (class indices)" in unlabelled.stderr


def test_recal_plan_reads_token_ids_as_a_decoder_lm(tmp_path, monkeypatch):
    """Integer ``inputs`` of (samples, tokens) without labels: next-token cross-entropy on the model's logits."""
    import numpy as np

    from tests.support.cli_in_process import run_recal

    (tmp_path / "lm.py").write_text(
        "import torch\nfrom torch import nn\n\n\ndef build():\n    torch.manual_seed(0)\n"
        "    return nn.Sequential(nn.Embedding(32, 64), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 32))\n")
    ids = np.random.default_rng(0).integers(0, 32, (16, 12))
    np.savez(tmp_path / "tokens.npz", inputs=ids)
    monkeypatch.chdir(tmp_path)
    result = run_recal("plan", "--model", "lm:build", "--data", "tokens.npz", "--budget", "bits=3", "--no-progress")
    assert result.returncode == 0, result.stderr
    assert "planned 2 layers" in result.stdout and "left out: 0:" in result.stdout
    assert load_recipe(str(tmp_path / "plan.yaml")).modifiers
