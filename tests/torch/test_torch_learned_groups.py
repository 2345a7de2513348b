"""recal_torch.training.learned_groups: recal's param groups kept apart in an optimizer's state dict."""

import torch
from torch import nn


def test_recal_param_groups_split_from_an_optimizer_state_and_join_back_in_place():
    """A user's group added after recal's: split leaves an optimizer state the user's own optimizer loads; join puts
    recal's group back at its place with its moments, equal to the original."""
    from recal_torch.training import join_learned_groups, split_learned_groups

    a, scale, b = nn.Parameter(torch.ones(3)), nn.Parameter(torch.ones(1)), nn.Parameter(torch.ones(2))
    optimizer = torch.optim.AdamW([{"params": [a]}, {"params": [scale], "recal_lr_factor": 0.1, "lr": 1e-4},
                                   {"params": [b], "lr": 5e-3}], lr=1e-3)
    for p in (a, scale, b):
        p.grad = torch.full_like(p, 0.5)
    optimizer.step()
    state = optimizer.state_dict()
    theirs, learned = split_learned_groups(state)
    assert [g["lr"] for g in theirs["param_groups"]] == [1e-3, 5e-3] and learned["positions"] == [1]
    users = torch.optim.AdamW([{"params": [a]}, {"params": [b], "lr": 5e-3}], lr=1e-3)
    users.load_state_dict(theirs)  # the optimizer a framework rebuilds takes it as is
    assert torch.equal(users.state[b]["exp_avg"], optimizer.state[b]["exp_avg"])
    joined = join_learned_groups(theirs, learned)
    assert joined["param_groups"] == state["param_groups"] and joined["state"].keys() == state["state"].keys()
    assert split_learned_groups(theirs) == (theirs, None)
