"""Two CPU processes under DistributedDataParallel (gloo): identical masks, exact final sparsity."""

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.support.ports import free_ports

RECIPE = """
- !EpochRangeModifier {start_epoch: 0, end_epoch: 3}
- !GradualKSModifier {params: [conv2, fc.weight], init_sparsity: 0.2, final_sparsity: 0.75, start_epoch: 0,
                      end_epoch: 2, update_frequency: 0.5}
- !QuantizationModifier {start_epoch: 2.5}
"""


LSQ_RECIPE = """
- !QuantizationModifier {start_epoch: 1, scheme_overrides: {fc: {input_activations: null,
    weights: {num_bits: 4, group_size: 16, observer: lsq}}}}
"""


def _worker(rank: int, world: int, port: int, out_dir: str, recipe: str = RECIPE, width: int = 8) -> None:
    from recal_torch import ScheduledModifierManager
    from tests.support.torch_models import SmallCNN, batches, train_steps

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(SmallCNN(width=width))
    manager = ScheduledModifierManager.from_yaml(recipe)
    optimizer = manager.modify(model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), steps_per_epoch=4)
    data = batches(12, seed=rank)  # each rank its own shard
    train_steps(model, optimizer, data)
    state = {n: p.detach().clone() for n, p in model.module.state_dict().items()}
    torch.save({"state": state, "masks": {k: v.clone() for k, v in manager.masks.effective.items()},
                "targets": manager.plan.prune_targets}, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


@pytest.mark.slow
def test_ddp_two_ranks_identical_masks_and_exact_sparsity(tmp_path):
    port = free_ports()[0]
    mp.spawn(_worker, args=(2, port, str(tmp_path)), nprocs=2, join=True)
    r0 = torch.load(tmp_path / "rank0.pt")
    r1 = torch.load(tmp_path / "rank1.pt")
    assert r0["targets"][1] == ["module.conv2.weight", "module.fc.weight"]
    assert r0["masks"].keys() == r1["masks"].keys() and r0["masks"]
    for name in r0["masks"]:
        assert torch.equal(r0["masks"][name], r1["masks"][name]), name
    for name in ("conv2.weight", "fc.weight"):
        w0, w1 = r0["state"][name], r1["state"][name]
        assert torch.equal(w0, w1)
        assert int((w0 == 0).sum()) == int(0.75 * w0.numel() + 0.5)
    # QAT observers agree across ranks (their statistics are reduced over ranks)
    for key in r0["state"]:
        if key.endswith(("scale", "zero_point", "min_val", "max_val")):
            assert torch.equal(r0["state"][key], r1["state"][key]), key


@pytest.mark.slow
def test_ddp_learned_scales_agree_across_ranks(tmp_path):
    """Learned (lsq) scales appear at QAT's start, after DDP wrapped the model, so DDP does not reduce their
    gradients: recal averages them over the ranks, and both ranks, each on its own shard, end on the same scales."""
    port = free_ports()[0]
    mp.spawn(_worker, args=(2, port, str(tmp_path), LSQ_RECIPE, 16), nprocs=2, join=True)
    r0, r1 = torch.load(tmp_path / "rank0.pt"), torch.load(tmp_path / "rank1.pt")
    scale = "fc.weight_fake_quant.scale"
    assert scale in r0["state"] and torch.equal(r0["state"][scale], r1["state"][scale])
    assert torch.equal(r0["state"]["fc.weight"], r1["state"]["fc.weight"])
