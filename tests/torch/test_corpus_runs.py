"""Every SparseML recipe of the corpus that loads also runs: a few PyTorch steps on a stand-in model built
from the names its ``params`` and ``submodules`` match, with every modifier applied. Masks exact, for every recipe
that prunes: each masked weight is zero exactly where its mask in force is, and each modifier's own mask holds the
count the core's plan says (per layer, across a global modifier's layers, per second-order group)."""

import copy
import re
import warnings

import pytest
import torch
from torch import nn

from recal_core import RecipeError, load_recipe
from recal_core import modifiers as M
from recal_core.model_plan import is_second_order, second_order_group
from recal_core.schedules import pruned_count
from recal_core.errors import RecipeWarning
from recal_torch import ScheduledModifierManager

from tests.support.paths import CORPUS

FILES = sorted(CORPUS.iterdir()) if CORPUS.is_dir() else []
WIDTH = 8  # every stand-in layer is Linear(8, 8): blocks of 4 and 2:4 divide it


def _loads(path):
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RecipeWarning)  # SparseML 1.x defaults, each warned (test_compat_corpus)
            return load_recipe(path)
    except RecipeError:
        return None


LOADED = [(p, r) for p in FILES if (r := _loads(p)) is not None]


def _example(pattern: str) -> str:
    """A name a ``re:`` pattern fully matches (the corpus's patterns: ``.*``, ``\\d+``, classes, groups)."""
    text = pattern
    text = re.sub(r"\(\?:|\(|\)", "", text)
    text = text.replace("\\d+", "0").replace("\\d", "0").replace(".*", "0").replace(".+", "0")
    text = re.sub(r"\[[^\]]*\]\*?", "0", text)
    text = text.replace("\\.", ".").replace("$", "").replace("^", "")
    text = re.sub(r"\|.*", "", text)
    return text.replace("?", "").replace("*", "").replace("+", "")


def _layer_names(recipe) -> set[str]:
    names = set()
    for m in recipe.modifiers:
        spec = getattr(m, "params", None)
        for entry in ((spec,) if isinstance(spec, str) else spec or ()):
            if entry in (M.ALL, M.ALL_PRUNABLE):
                continue
            name = _example(entry[3:]) if entry.startswith("re:") else entry
            names.add(name[: -len(".weight")] if name.endswith(".weight") else name.rsplit(".", 1)[0]
                      if name.endswith(".bias") else name)
        for sub in getattr(m, "submodules", None) or ():
            names.add(sub)
    return names or {"features.0", "classifier"}


class StandIn(nn.Module):
    """Linear layers at the dotted names, chained in name order, so every name resolves and trains."""

    def __init__(self, names):
        super().__init__()
        self.output_keys: list[str] = []
        self.order = sorted(names)
        for name in self.order:
            parent = self
            parts = name.split(".")
            for part in parts[:-1]:
                if not hasattr(parent, part):
                    parent.add_module(part, nn.Module())
                parent = getattr(parent, part)
            if not hasattr(parent, parts[-1]):
                parent.add_module(parts[-1], nn.Linear(WIDTH, WIDTH))

    def forward(self, x):
        for name in self.order:
            layer = self.get_submodule(name)
            if isinstance(layer, nn.Linear):
                x = torch.tanh(layer(x))  # bounded: any LR a recipe sets keeps it finite
        return {key: x * (i + 1) for i, key in enumerate(self.output_keys)} if self.output_keys else x


@pytest.mark.skipif(not LOADED, reason=f"compatibility corpus not found at {CORPUS}")
@pytest.mark.filterwarnings("ignore:.*(grad_sampler_kwargs|available_gpus) is not used:UserWarning")
@pytest.mark.filterwarnings("ignore:.*(names no module|which recal's QAT leaves float):UserWarning")
@pytest.mark.parametrize("path, recipe", LOADED, ids=[p.name for p, _ in LOADED])
def test_corpus_recipe_runs_in_pytorch(path, recipe):
    torch.manual_seed(0)
    model = StandIn(_layer_names(recipe))
    keys = [k for _, m in recipe.of_type(M.DistillationModifier) for k in (m.distill_output_keys or ())]
    model.output_keys = list(dict.fromkeys(keys))  # a model with the named outputs the recipe distils
    teacher = copy.deepcopy(model) if any(True for _ in recipe.of_type(M.DistillationModifier)) else None
    groups = 1 + max((g for m in recipe.modifiers for g in (getattr(m, "param_groups", None) or ())), default=0)
    params = list(model.parameters())
    split = [params[i::groups] for i in range(groups)]  # as many param groups as the recipe names
    manager = ScheduledModifierManager(recipe)
    optimizer = manager.modify(model, torch.optim.SGD([{"params": p} for p in split], lr=0.01, momentum=0.9,
                                                      weight_decay=1e-5), steps_per_epoch=1, teacher=teacher)
    steps = min(manager.schedule.total_steps, 60)
    for _ in range(steps):
        x = torch.randn(4, WIDTH)
        optimizer.zero_grad()
        out = model(x)
        first = out[model.output_keys[0]] if model.output_keys else out
        loss = manager.loss(first.pow(2).mean(), x, out)
        if loss.requires_grad:  # a recipe may freeze every parameter for a while
            loss.backward()
        optimizer.step()
    _assert_masks_exact(manager, model, steps)
    assert all(torch.isfinite(p).all() for p in model.parameters())


def _assert_masks_exact(manager, model, steps):
    """The masks after ``steps``: applied exactly, and each modifier's count what the plan says."""
    params, state, plan = dict(model.named_parameters()), manager.masks, manager.plan
    checked = 0
    for name, mask_plan in plan.masks.items():
        in_force = mask_plan.in_force(steps)
        effective = state.effective.get(name)
        assert (effective is None) == (not in_force), name
        if effective is None:
            continue
        assert torch.equal(params[name] == 0, effective == 0), name  # zero exactly where the mask is
        checked += 1
        for ps in mask_plan.sources:
            if ps.index not in in_force or ps.index in mask_plan.coupled:
                continue
            own = int((state.masks[name][ps.index] == 0).sum())
            if ps.constant:  # the zeros the weight held at its start: none in a dense stand-in pruned by nothing else
                if len(mask_plan.sources) == 1:
                    assert own == 0, name
                continue
            if is_second_order(ps):
                size = second_order_group(ps.modifier)
                if not ps.modifier.global_sparsity:
                    assert own == size * pruned_count(ps.sparsity(steps), mask_plan.numel // size), name
            elif not ps.modifier.global_sparsity:
                assert own == mask_plan.zeros(ps, steps), (name, ps.index)
    for ps in plan.schedule.pruning:  # a global modifier: one count across its layers
        names = plan.prune_targets.get(ps.index, [])
        if ps.constant or not ps.modifier.global_sparsity or not names or not ps.mask_in_force(steps):
            continue
        total = sum(int((state.masks[n][ps.index] == 0).sum()) for n in names)
        if is_second_order(ps):
            size = second_order_group(ps.modifier)
            expected = size * pruned_count(ps.sparsity(steps), sum(plan.masks[n].numel // size for n in names))
        else:
            expected = plan.global_zeros(ps.index, steps)
        assert total == expected, (ps.index, total, expected)
    prunes = any(plan.prune_targets.get(ps.index) and ps.mask_in_force(steps) for ps in plan.schedule.pruning)
    assert checked or not prunes  # a recipe that prunes had its masks checked
