"""A recipe planned from measurement (issue 71): the search is exact, a budget it cannot meet names the nearest
one, and the plan is a recipe recal trains, giving bits where the loss needs them."""

import itertools

import numpy as np
import pytest
import torch
from torch import nn

from recal_core import load_recipe
from recal_core.precision_plan import FLOAT, Candidate, LayerCandidates, PlanError, cheapest, size_bounds, solve


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


def _timed(layers, rng):
    return [LayerCandidates(layer.name, layer.params, tuple(
        Candidate(c.bits, c.cost, c.score, float(rng.uniform(0.01, 1.0))) for c in layer.candidates))
        for layer in layers]


@pytest.mark.parametrize("cost", ["latency", "score"])
def test_a_latency_or_loss_budget_is_solved_exactly_too(cost):
    """``cost="latency"``: least summed score within the summed ms; ``cost="score"``: fewest bytes within the summed
    score; both against every plan there is."""
    rng = np.random.default_rng(2)
    for _ in range(20):
        layers = _timed(_random_layers(rng, 4), rng)
        low, high = size_bounds(layers, cost)
        budget = float(rng.uniform(low, high))
        value = (lambda c: c.latency) if cost == "latency" else (lambda c: c.score)
        aim = (lambda c: c.score) if cost == "latency" else (lambda c: c.cost)
        combos = [combo for combo in itertools.product(*(layer.candidates for layer in layers))
                  if sum(map(value, combo)) <= budget]
        best = min(sum(map(aim, combo)) for combo in combos)
        choice = solve(layers, budget, cost)
        assert sum(map(value, choice.values())) <= budget + 1e-9
        assert sum(map(aim, choice.values())) == pytest.approx(best, abs=1e-9)
    with pytest.raises(PlanError, match="a latency budget needs each candidate timed"):
        solve(_random_layers(rng, 2), 1.0, "latency")


def test_a_latency_budget_within_a_size_is_exact_and_an_impossible_pair_names_the_nearest():
    rng = np.random.default_rng(3)
    for _ in range(20):
        layers = _timed(_random_layers(rng, 4), rng)
        ms = float(rng.uniform(*size_bounds(layers, "latency")))
        size = float(rng.uniform(*size_bounds(layers)))
        combos = [combo for combo in itertools.product(*(layer.candidates for layer in layers))
                  if sum(c.latency for c in combo) <= ms and sum(c.cost for c in combo) <= size]
        if not combos:
            least = min(sum(c.latency for c in combo) for combo in itertools.product(*(
                layer.candidates for layer in layers)) if sum(c.cost for c in combo) <= size)
            with pytest.raises(PlanError, match=f"within those, the least latency is {least:.4g} ms"):
                solve(layers, ms, "latency", within={"bytes": size})
            continue
        fastest = cheapest(layers, "latency", {"bytes": size})
        assert sum(c.latency for c in fastest.values()) == pytest.approx(min(
            sum(c.latency for c in combo) for combo in itertools.product(*(layer.candidates for layer in layers))
            if sum(c.cost for c in combo) <= size))
        choice = solve(layers, ms, "latency", within={"bytes": size})
        assert sum(c.latency for c in choice.values()) <= ms + 1e-9
        assert sum(c.cost for c in choice.values()) <= size + 1e-9
        assert sum(c.score for c in choice.values()) == pytest.approx(
            min(sum(c.score for c in combo) for combo in combos), abs=1e-9)


def test_a_search_cut_by_its_time_limit_says_so(monkeypatch):
    """The integer program has a time limit: past it, the best plan found is written with a warning saying it is not
    proven the best, or, with none found, a PlanError says the limit (never a claim that no plan exists)."""
    from recal_core import precision_plan

    monkeypatch.setattr(precision_plan, "SEARCH_SECONDS", 1e-9)
    layers = _random_layers(np.random.default_rng(5), 60)
    low, high = size_bounds(layers)
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            choice = solve(layers, (low + high) / 2)
        except PlanError as exc:
            assert "found no plan within its 0 s limit" in str(exc)
            return
    assert any("stopped at its 0 s limit before proving" in str(w.message) for w in caught)
    assert sum(c.cost for c in choice.values()) <= (low + high) / 2


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


def test_plan_precision_plans_latency_through_the_timer_it_is_given():
    """``latency_budget`` with ``timer``: the timer's times decide (here 4 bits is the fast grid and 2 bits slow, as
    MatMulNBits runs today); with a size too, the plan keeps within both; without a timer, a located refusal."""
    from recal_torch.precision_plan import plan_precision

    net, batches = _net_and_data()
    loss = lambda m, b: nn.functional.cross_entropy(m(b[0]), b[1])  # noqa: E731
    speed = {FLOAT: 1.0, 8: 3.0, 4: 0.5, 2: 2.0}

    def timer(layers, group_size, progress):
        assert all(layer.in_features and layer.rows == 1 for layer in layers)
        return [LayerCandidates(layer.name, layer.params, tuple(
            Candidate(c.bits, c.cost, c.score, speed[c.bits] * layer.params / 4096) for c in layer.candidates),
            layer.in_features, layer.out_features, layer.rows, layer.bias) for layer in layers]

    fast = plan_precision(net, batches, loss, latency_budget=1.0 + 0.5 + 0.5 * 8 / 64, timer=timer)
    assert {name: c.bits for name, c in fast.choice.items()} == {"0": 4, "2": FLOAT, "4": 4}, fast.recipe
    assert "under 1.562 ms" in fast.recipe and fast.latency == pytest.approx(1.5625)
    small = plan_precision(net, batches, loss, latency_budget=1.6, budget=fast.size - 1, timer=timer)
    assert small.size <= fast.size - 1 and small.latency <= 1.6
    assert f"within {fast.size - 1:,.0f} bytes" in small.recipe
    with pytest.raises(ValueError, match="latency_budget needs timer=recal_onnx.timed_candidates"):
        plan_precision(net, batches, loss, latency_budget=1.0)
    with pytest.raises(ValueError, match="loss_budget plans the fewest bytes"):
        plan_precision(net, batches, loss, loss_budget=1.0, budget=1e6)


def test_recal_plan_writes_the_recipe_the_api_plans_and_its_pareto_plot(tmp_path, monkeypatch):
    """``recal plan --model module:function --data calibration.npz --budget bits=4``: the same recipe as
    ``plan_precision`` on the same batches, one ``recal check`` reads, and the Pareto curve as a PNG; a budget no
    plan meets names the smallest, a latency budget plans the layers' times in onnxruntime (one it cannot meet names
    the fastest plan's), data without labels that are not token ids says what to give."""
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
    monkeypatch.setenv("RECAL_CACHE", str(tmp_path / "cache"))
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
    latency = run_recal(*args, "--budget", "latency=5ms", "--rows", "1", "--output", "fast.yaml", "--plot", "fast.png")
    assert latency.returncode == 0, latency.stderr
    assert (tmp_path / "fast.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"  # the curve over milliseconds
    assert "ms in onnxruntime here" in latency.stdout and (tmp_path / "cache" / "layer_latency.json").is_file()
    text = (tmp_path / "fast.yaml").read_text()
    assert "each timed alone in onnxruntime on this CPU" in text and run_recal("check", "fast.yaml").returncode == 0
    spent = float(text.split("its layers take ")[1].split(" ms")[0])
    assert spent <= 5.0
    slow = run_recal(*args, "--budget", "latency=1us", "--output", "slow.yaml")
    assert slow.returncode == 2 and "the fastest plan, every layer at its fastest candidate, takes" in slow.stderr
    assert not (tmp_path / "slow.yaml").exists()
    for budget, said in (("latency=5", "with its unit"), ("loss=-1", "of 0 or more"), ("speed=3", "expected size=")):
        bad = run_recal(*args, "--budget", budget)
        assert bad.returncode == 2 and said in bad.stderr, (budget, bad.stderr)
    both = run_recal(*args, "--budget", "latency=5ms", "--budget", "size=9kB", "--output", "both.yaml")
    assert both.returncode == 0 and "within 9,000 bytes" in (tmp_path / "both.yaml").read_text(), both.stderr
    pair = run_recal(*args, "--budget", "size=9kB", "--budget", "bits=4")
    assert pair.returncode == 2 and "latency=... with one of size=... or bits=..." in pair.stderr
    rows = run_recal(*args, "--budget", "bits=4", "--rows", "1")
    assert rows.returncode == 2 and "counts only with --budget latency" in rows.stderr
    (tmp_path / "kerasish.py").write_text("def build():\n    return {'layers': []}\n")
    other = run_recal("plan", "--model", "kerasish:build", *args[3:], "--budget", "bits=4")
    assert other.returncode == 2 and "not a torch.nn.Module (recal plan measures PyTorch models" in other.stderr
    (tmp_path / "kerasmodels.py").write_text("import keras\n\n\ndef build():\n    return keras.Sequential("
                                             "[keras.Input((4,)), keras.layers.Dense(2)])\n")
    keras_model = run_recal("plan", "--model", "kerasmodels:build", *args[3:], "--budget", "bits=4")
    assert keras_model.returncode == 2 and "not trained by recal_keras or recal_tf" in keras_model.stderr
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
    args = ["plan", "--model", "lm:build", "--data", "tokens.npz", "--budget", "bits=3", "--no-progress", "-o"]
    pruned = run_recal(*args, "pruned.yaml", "--prune-levels", "0.25,0.5")  # the ReLU's channels: made by one
    assert pruned.returncode == 0 and "thinned (recal_torch.thin after training)" in pruned.stdout  # planned layer,
    assert "params: ['1.weight']" in (tmp_path / "pruned.yaml").read_text()  # read by the other: prunable
    assert run_recal("check", "pruned.yaml").returncode == 0
    bad = run_recal(*args, "bad.yaml", "--prune-levels", "0.5,1.5")
    assert bad.returncode == 2 and "expected shares above 0 and below 1" in bad.stderr


def test_a_pruning_group_takes_one_sparsity_and_the_search_stays_exact():
    """Layers of one channel space (``group``) each offer every precision at every sparsity; the plan gives them all
    one sparsity, and is still the best such plan there is."""
    rng = np.random.default_rng(4)
    for _ in range(15):
        layers = []
        for i in range(3):
            params = int(rng.integers(100, 2000))
            layers.append(LayerCandidates(f"l{i}", params, tuple(
                Candidate(b, params * b / 8 * (1 - s), float(rng.exponential(1.0)) * (b < FLOAT) + s * rng.uniform(1, 3),
                          sparsity=s, kept=None if not s else 10)
                for s in (0.0, 0.5) for b in (2, 4, FLOAT)), 8, 8, 1, False, "g" if i < 2 else "",
                ("outputs" if i == 0 else "inputs") if i < 2 else ""))
        budget = float(rng.uniform(*size_bounds(layers)))
        combos = [combo for combo in itertools.product(*(layer.candidates for layer in layers))
                  if combo[0].sparsity == combo[1].sparsity and sum(c.cost for c in combo) <= budget]
        if not combos:
            continue
        choice = solve(layers, budget)
        assert choice["l0"].sparsity == choice["l1"].sparsity
        assert sum(c.score for c in choice.values()) == pytest.approx(min(sum(c.score for c in combo) for combo in combos))


def _llama_with_weak_mlp_channels():
    """A two-block Llama (a Hugging Face config, random weights) whose MLPs carry almost nothing in half their hidden
    channels, and next-token batches over random bytes."""
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=1, num_key_value_heads=1, max_position_embeddings=64)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for block in model.model.layers:
            block.mlp.up_proj.weight[64:] *= 1e-3
    batches = [(torch.randint(0, 256, (4, 32)),) for _ in range(2)]

    def loss(m, b):
        logits = m(input_ids=b[0], use_cache=False).logits[:, :-1]
        return nn.functional.cross_entropy(logits.reshape(-1, 256), b[0][:, 1:].reshape(-1))

    return model, batches, loss


def test_pruning_is_planned_with_the_precision_and_the_recipe_prunes_and_thins_it():
    """``prune_levels``: each MLP's hidden channels (half of them nearly dead) are pruned by the plan where a size
    budget needs room, written as a filter-pruning modifier on the layers making them, which recal trains and
    ``thin`` removes: the recipe does what the plan says."""
    from recal_torch.precision_plan import plan_precision

    from tests.support.torch_models import train_planned

    model, batches, loss = _llama_with_weak_mlp_channels()
    full = plan_precision(model, batches, loss, bits_budget=8.5)
    assert not any(c.sparsity for c in full.choice.values())  # no pruning asked: none planned
    plan = plan_precision(model, batches, loss, budget=0.5 * full.size, prune_levels=(0.25, 0.5))
    levels = {name.split("layers.")[-1]: c.sparsity for name, c in plan.choice.items() if ".mlp." in name}
    assert set(levels.values()) == {0.5}, plan.recipe  # gate, up and down of both blocks: one share each
    assert plan.size <= 0.5 * full.size
    assert "mask_type: filter" in plan.recipe and "'model.layers.0.mlp.gate_proj.weight'" in plan.recipe
    train_planned(model, plan.recipe, batches, loss, lr=1e-4, steps=len(batches))
    mlp = model.model.layers[0].mlp
    assert mlp.gate_proj.out_features == mlp.up_proj.out_features == mlp.down_proj.in_features == 64


def test_pruning_asked_where_no_channel_space_can_be_pruned_is_said():
    from recal_torch.precision_plan import plan_precision

    x, y = torch.randn(16, 32), torch.randint(0, 8, (16,))
    loss = lambda m, b: nn.functional.cross_entropy(m(b[0]), b[1])  # noqa: E731
    with pytest.warns(UserWarning, match="nothing is pruned: no channel space"):
        plan = plan_precision(nn.Sequential(nn.Linear(32, 8)), [(x, y)], loss, bits_budget=8, prune_levels=(0.5,))
    assert "GradualKSModifier" not in plan.recipe


class _Branchy(nn.Module):
    """An MLP whose forward branches on its input's rank: torch.fx cannot trace it, torch.export can."""

    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(32, 64), nn.Linear(64, 8)

    def forward(self, x):
        if x.dim() == 3:
            x = x.flatten(0, 1)
        return self.down(torch.relu(self.up(x)))


def test_pruning_traced_on_the_calibration_batch_says_to_give_modify_the_same():
    from recal_torch.precision_plan import plan_precision

    torch.manual_seed(0)
    x, y = torch.randn(32, 32), torch.randint(0, 8, (32,))
    loss = lambda m, b: nn.functional.cross_entropy(m(b[0]), b[1])  # noqa: E731
    with pytest.warns(UserWarning, match=r"train the planned recipe with modify\(\.\.\., example_inputs=<a batch>\)"):
        plan = plan_precision(_Branchy(), [(x, y)], loss, bits_budget=3, prune_levels=(0.5,))
    assert {layer.group for layer in plan.layers} == {"up"}  # up makes the channels, down reads them
