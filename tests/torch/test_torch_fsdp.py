"""Two CPU processes under FSDP2 (``fully_shard``, gloo): the recipe's masks, LR and weights are those of the
single-process run of the same recipe on the same batches; a sharded checkpoint resumes exactly; recal's state in
it holds whole masks, so it also resumes a single-process run."""

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from tests.support.ports import free_ports

RECIPE = """
- !EpochRangeModifier {start_epoch: 0, end_epoch: 3}
- !LearningRateModifier {start_epoch: 0, end_epoch: 2, lr_class: ExponentialLR, lr_kwargs: {gamma: 0.5}, init_lr: 0.1}
- !GMPruningModifier {params: [0.weight], init_sparsity: 0.1, final_sparsity: 0.5, start_epoch: 0, end_epoch: 2,
                      update_frequency: 0.5}
- !GMPruningModifier {params: [2.weight, 4.weight], init_sparsity: 0.1, final_sparsity: 0.7, start_epoch: 0,
                      end_epoch: 2, update_frequency: 0.5, global_sparsity: true}
- !GMPruningModifier {params: [2.weight], init_sparsity: 0.25, final_sparsity: 0.25, start_epoch: 1, end_epoch: 2,
                      update_frequency: 1,
                      mask_type: filter}
"""
STEPS_PER_EPOCH, STEPS, BATCH = 4, 12, 16


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))


def _batches():
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(BATCH, 16, generator=g), torch.randint(0, 4, (BATCH,), generator=g)) for _ in range(STEPS)]


def _train(model, optimizer, batches, rank: int = 0, world: int = 1) -> None:
    for x, y in batches:
        share = BATCH // world  # each rank its half of the batch: FSDP averages the gradients over the ranks
        loss = nn.functional.cross_entropy(model(x[rank * share:(rank + 1) * share]), y[rank * share:(rank + 1) * share])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


def _sharded(model: nn.Module) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    return fully_shard(model)


def _setup(shard: bool):
    from recal_torch import ScheduledModifierManager

    model = _sharded(_model()) if shard else _model()
    manager = ScheduledModifierManager.from_yaml(RECIPE)
    optimizer = manager.modify(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                               steps_per_epoch=STEPS_PER_EPOCH)
    return model, optimizer, manager


def _whole(model) -> dict[str, torch.Tensor]:
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone() for k, v in model.state_dict().items()}


def _worker(rank: int, world: int, port: int, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    batches = _batches()
    model, optimizer, manager = _setup(shard=True)
    assert type(model[0].weight).__name__ == "DTensor"
    _train(model, optimizer, batches, rank, world)
    straight = _whole(model)
    lr = optimizer.param_groups[0]["lr"]
    masks = {k: v.full_tensor().clone() for k, v in manager.masks.effective.items()}

    # a sharded checkpoint (each rank its file) halfway, resumed in a fresh model and optimizer
    model, optimizer, manager = _setup(shard=True)
    _train(model, optimizer, batches[:STEPS // 2], rank, world)
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, os.path.join(out, f"r{rank}.pt"))
    full_recal_state = manager.state_dict()
    model, optimizer, manager = _setup(shard=True)
    saved = torch.load(os.path.join(out, f"r{rank}.pt"), weights_only=False)  # the test's own file
    optimizer.load_state_dict(saved["optimizer"])  # recal's part first (its hook), then the optimizer's
    model.load_state_dict(saved["model"])
    _train(model, optimizer, batches[STEPS // 2:], rank, world)
    resumed = _whole(model)
    qat = {}
    for scheme in SELF_SHARDED_QAT:  # QAT takes over layers fully_shard wrapped themselves
        model, optimizer, _ = _self_sharded_qat(True, scheme)
        _train(model, optimizer, batches, rank, world)
        qat[scheme] = {**_whole(model), "classes": [type(m).__name__ for m in model]}
    torch.save({"straight": straight, "resumed": resumed, "lr": lr, "masks": masks, "recal": full_recal_state,
                "half": _whole_half(saved["model"]), "qat": qat}, os.path.join(out, f"rank{rank}.pt"))
    dist.destroy_process_group()


SELF_SHARDED_QAT = {"int8": "{start_epoch: 1}", "int4": "{start_epoch: 1, scheme: {input_activations: null, "
                                                           "weights: {num_bits: 4, group_size: 16}}}"}


def _self_sharded_qat(shard: bool, scheme: str = "int8"):
    """QAT from step 4 on a model whose Linear layers ``fully_shard`` wrapped each on its own (as accelerate shards
    the embeddings and the LM head): QAT (W8A8, or int4 weight-only) takes them over in place."""
    from recal_torch import ScheduledModifierManager

    model = _sharded(_model()) if shard else _model()
    manager = ScheduledModifierManager.from_yaml("- !EpochRangeModifier {start_epoch: 0, end_epoch: 3}\n"
                                                 f"- !QuantizationModifier {SELF_SHARDED_QAT[scheme]}")
    return model, manager.modify(model, torch.optim.SGD(model.parameters(), lr=0.1), STEPS_PER_EPOCH), manager


def _whole_half(state) -> dict[str, torch.Tensor]:
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone() for k, v in state.items()}


@pytest.mark.slow
def test_fsdp2_two_ranks_match_the_single_process_run_and_resume_exactly(tmp_path):
    mp.spawn(_worker, args=(2, free_ports()[0], str(tmp_path)), nprocs=2, join=True)
    r0, r1 = torch.load(tmp_path / "rank0.pt", weights_only=False), torch.load(tmp_path / "rank1.pt", weights_only=False)

    model, optimizer, manager = _setup(shard=False)
    _train(model, optimizer, _batches())
    single = {k: v.detach().clone() for k, v in model.state_dict().items()}
    for r in (r0, r1):
        assert r["masks"].keys() == manager.masks.effective.keys()
        for name, mask in manager.masks.effective.items():
            assert torch.equal(r["masks"][name], mask), name  # the same masks as one process, on every rank
        for name, tensor in single.items():
            torch.testing.assert_close(r["straight"][name], tensor, rtol=1e-5, atol=1e-6)
            assert torch.equal(r["resumed"][name], r["straight"][name]), name  # resumed: bit for bit
        assert r["lr"] == optimizer.param_groups[0]["lr"] == pytest.approx(0.1 * 0.5)  # epoch 1, then held
    for scheme, first in (("int8", "FSDPQATTorchLinear"), ("int4", "FSDPWeightOnlyTorchLinear")):
        model, optimizer, _ = _self_sharded_qat(False, scheme)
        _train(model, optimizer, _batches())
        # each Linear its QAT layer (W8A8: ReLU fused into it) as in one process, still FSDP's unit
        sharded = r0["qat"][scheme]
        assert sharded["classes"] == [("FSDP" if "QAT" in type(m).__name__ or "WeightOnly" in type(m).__name__
                                       else "") + type(m).__name__ for m in model]
        assert sharded["classes"][0] == first and any("fake_quant" in k for k in sharded)
        for name, tensor in model.state_dict().items():
            torch.testing.assert_close(sharded[name], tensor, rtol=1e-4, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
    assert int((single["2.weight"] == 0).all(1).sum()) >= 8  # the filter modifier removed a quarter of the rows

    # recal's state from the sharded run holds whole masks: a single-process run resumes from it
    model = _model()
    from recal_torch import ScheduledModifierManager

    manager = ScheduledModifierManager.from_yaml(RECIPE)
    optimizer = manager.modify(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                               steps_per_epoch=STEPS_PER_EPOCH)
    manager.load_state_dict(r0["recal"])
    model.load_state_dict(r0["half"])
    assert manager.step == STEPS // 2
    for name, mask in manager.masks.effective.items():
        assert mask.shape == model.get_parameter(name).shape and ((mask == 0) == (r0["half"][name] == 0)).all()


QAT_RECIPE = """
- !EpochRangeModifier {start_epoch: 0, end_epoch: 3}
- !GMPruningModifier {params: ['re:.*\\.0\\.weight'], init_sparsity: 0.1, final_sparsity: 0.5, start_epoch: 0,
                      end_epoch: 2, update_frequency: 0.5}
- !QuantizationModifier
  start_epoch: 1
  scheme: {input_activations: {symmetric: false, observer: lsq}, weights: {}}
"""


def _blocks() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Sequential(nn.Linear(16, 32), nn.ReLU()), nn.Sequential(nn.Linear(32, 32), nn.ReLU()),
                         nn.Linear(32, 4))


def _qat_setup(shard: bool, adamw: bool = False):
    """SGD with learned input scales, or AdamW at an ordinary LR with learned weight scales too (log space)."""
    from torch.distributed.fsdp import fully_shard

    from recal_torch import ScheduledModifierManager

    model = _blocks()
    if shard:  # the blocks and the model, as a transformer's layers are sharded: QAT replaces the layers inside
        fully_shard(model[0])
        fully_shard(model[1])
        fully_shard(model)
    recipe = QAT_RECIPE.replace("weights: {}", "weights: {observer: lsq}") if adamw else QAT_RECIPE
    manager = ScheduledModifierManager.from_yaml(recipe)
    optimizer = (torch.optim.AdamW(model.parameters(), lr=1e-3) if adamw else
                 torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    return model, manager.modify(model, optimizer, steps_per_epoch=STEPS_PER_EPOCH), manager


def _qat_worker(rank: int, world: int, port: int, out: str, adamw: bool = False) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    batches = _batches()
    model, optimizer, _ = _qat_setup(shard=True, adamw=adamw)
    _train(model, optimizer, batches, rank, world)
    straight = _whole(model)
    model, optimizer, manager = _qat_setup(shard=True, adamw=adamw)
    _train(model, optimizer, batches[:STEPS // 2 + 1], rank, world)  # into QAT (epoch 1 starts at step 4)
    saved = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
    model, optimizer, manager = _qat_setup(shard=True, adamw=adamw)
    optimizer.load_state_dict(saved["optimizer"])
    model.load_state_dict(saved["model"])
    _train(model, optimizer, batches[STEPS // 2 + 1:], rank, world)
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from recal_torch import export_onnx

    try:  # a sharded model does not export: the error says how to
        export_onnx(model, torch.randn(2, 16), os.path.join(out, f"direct{rank}.onnx"), dynamo=False)
        direct = "exported"
    except ValueError as err:
        direct = str(err)
    gathered = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))  # every rank takes part
    torch.save({"straight": straight, "resumed": _whole(model), "direct": direct, "gathered": gathered,
                "recal": manager.state_dict()}, os.path.join(out, f"qat{rank}.pt"))
    dist.destroy_process_group()


@pytest.mark.slow
def test_fsdp2_learned_scales_under_adamw_stay_within_a_tenth_of_a_percent_of_one_process(tmp_path):
    """AdamW normalizes each step, so float noise in a gradient near zero can flip a step's sign: on the raw scale,
    a full LR step on a scale of 1e-3 (2% of scales apart from one process, median). In log space a step moves a
    scale by a share of itself: every learned scale (weights' and inputs') within 0.1% of the one-process run, and
    a checkpoint resumes bit for bit."""
    mp.spawn(_qat_worker, args=(2, free_ports()[0], str(tmp_path), True), nprocs=2, join=True)
    model, optimizer, _ = _qat_setup(shard=False, adamw=True)
    _train(model, optimizer, _batches())
    single = {k: v.detach().clone() for k, v in model.state_dict().items() if k.endswith("fake_quant.scale")}
    assert sum(k.endswith("weight_fake_quant.scale") for k in single) == 3 and len(single) >= 4
    r = torch.load(tmp_path / "qat0.pt", weights_only=False)
    gaps = {k: float(((r["straight"][k] - v).abs() / v).max()) for k, v in single.items()}
    assert max(gaps.values()) <= 1e-3, gaps
    assert all(torch.equal(r["resumed"][k], r["straight"][k]) for k in single)


@pytest.mark.slow
def test_fsdp2_qat_with_learned_scales_matches_the_single_process_run_and_resumes_exactly(tmp_path):
    """QAT on a model whose blocks are sharded (FSDP2 gathers each block's weights in its forward; the QAT layers
    read them there): weights, observed ranges and learned input scales as in one process, and a sharded
    checkpoint taken during QAT resumes bit for bit."""
    mp.spawn(_qat_worker, args=(2, free_ports()[0], str(tmp_path)), nprocs=2, join=True)
    model, optimizer, _ = _qat_setup(shard=False)
    _train(model, optimizer, _batches())
    single = {k: v.detach().clone() for k, v in model.state_dict().items()}
    assert any(k.endswith("input_fake_quant.scale") for k in single)  # the learned scales are in the state
    for rank in (0, 1):
        r = torch.load(tmp_path / f"qat{rank}.pt", weights_only=False)
        assert r["straight"].keys() == single.keys()
        for name, tensor in single.items():
            torch.testing.assert_close(r["straight"][name].float(), tensor.float(), rtol=1e-4, atol=1e-5,
                                       msg=lambda m, name=name: f"{name}: {m}")
            assert torch.equal(r["resumed"][name], r["straight"][name]), name
        assert "sharded with fully_shard (FSDP2)" in r["direct"] and "get_model_state_dict" in r["direct"]

    # the export the error describes: the gathered weights and recal's state in an unsharded model, in one process
    from recal_onnx import quantize_qat_export
    from recal_torch import ScheduledModifierManager, export_onnx

    r0 = torch.load(tmp_path / "qat0.pt", weights_only=False)
    plain = _blocks()
    manager = ScheduledModifierManager.from_yaml(QAT_RECIPE)
    manager.modify(plain, torch.optim.SGD(plain.parameters(), lr=0.1), steps_per_epoch=STEPS_PER_EPOCH)
    manager.load_state_dict(r0["recal"])
    plain.load_state_dict(r0["gathered"])
    assert all(torch.equal(v, r0["resumed"][k]) for k, v in plain.state_dict().items())
    manager.finalize(plain)
    path = export_onnx(plain.eval(), torch.randn(2, 16), tmp_path / "gathered.onnx", dynamo=False)
    result = quantize_qat_export(str(path), tmp_path / "gathered.int8.onnx",
                                 inputs={"input": torch.randn(64, 16).numpy()})
    assert result.verification.problem(None) is None and result.verification.samples == 64
