"""recal in Hugging Face's ``Trainer`` and in Lightning: a recipe in, no loop of the user's; the framework's own
checkpoints resume exactly; its scheduler follows the recipe's LR."""

import math

import pytest
import torch
from torch import nn

from recal_core.datasets import load_digits

RECIPE = """
modifiers:
- !EpochRangeModifier {start_epoch: 0, end_epoch: 4}
- !LearningRateModifier {start_epoch: 0, end_epoch: 3, lr_class: ExponentialLR, lr_kwargs: {gamma: 0.7}, init_lr: 0.1}
- !GMPruningModifier {params: __ALL_PRUNABLE__, init_sparsity: 0.1, final_sparsity: 0.6, start_epoch: 0,
                      end_epoch: 2, update_frequency: 0.5}
- !QuantizationModifier {start_epoch: 1.5, freeze_bn_stats_epoch: 3, disable_quantization_observer_epoch: 3.5}
"""
SAMPLES, BATCH = 640, 64  # 10 steps an epoch


class DigitsNet(nn.Module):
    """The digits MLP, in the shape a Trainer wants: keyword inputs, a dict with the loss."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Flatten(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))

    def forward(self, pixels, labels=None):
        logits = self.body(pixels)
        return {"logits": logits} if labels is None else {"loss": nn.functional.cross_entropy(logits, labels),
                                                          "logits": logits}


def _digits():
    d = load_digits()
    return [{"pixels": torch.from_numpy(d.train_images[i]), "labels": int(d.train_labels[i])} for i in range(SAMPLES)]


def _hf_trainer(folder, callback, epochs=4):
    from transformers import Trainer, TrainingArguments

    torch.manual_seed(0)
    args = TrainingArguments(output_dir=str(folder), num_train_epochs=epochs, per_device_train_batch_size=BATCH,
                             learning_rate=0.1, optim="sgd", weight_decay=0.0, save_strategy="epoch", logging_steps=5,
                             report_to="none", use_cpu=True, seed=0, disable_tqdm=True, dataloader_num_workers=0)
    return Trainer(model=DigitsNet(), args=args, train_dataset=_digits(), callbacks=[callback])


def test_a_hugging_face_trainer_runs_the_recipe_and_resumes_exactly(tmp_path):
    pytest.importorskip("accelerate")
    from recal_torch import export_onnx
    from recal_torch.integrations import RecalTrainerCallback

    callback = RecalTrainerCallback(RECIPE)
    trainer = _hf_trainer(tmp_path, callback)
    trainer.train()
    model = trainer.model
    final = {k: v.clone() for k, v in model.state_dict().items()}
    # the recipe ran: 60% of each layer's weights are zero, QAT layers in place, the LR the recipe's at each log
    for layer in (model.body[1], model.body[3]):
        assert abs(float((layer.weight == 0).float().mean()) - 0.6) < 0.02
    assert any("fake_quant" in k or "scale" in k for k in final), "QAT left no quantizer state in the model"
    logged = [r for r in trainer.state.log_history if "learning_rate" in r]
    assert len(logged) == 8 and all("recal/sparsity/body.1.weight" in r for r in logged)
    for record in logged:  # the Trainer logs the LR of the step just taken (its 0-based index: step - 1); the
        # recipe's: 0.1, x0.7 an epoch to epoch 3, then held (not the Trainer's own linear decay to 0)
        assert record["learning_rate"] == pytest.approx(0.1 * 0.7 ** min(math.floor((record["step"] - 1) / 10), 2),
                                                        rel=1e-9)
        assert record["recal/lr"] == record["learning_rate"]  # one LR per record: the step just taken's
    assert not callback.manager.active  # finalized at the end: masks baked in, observers frozen
    export_onnx(model.body.eval(), torch.zeros(1, 8, 8), tmp_path / "digits.onnx")

    # the same run from the Trainer's checkpoint after epoch 2 (QAT began at 1.5): the same model, bit for bit
    again = _hf_trainer(tmp_path, RecalTrainerCallback(RECIPE))
    again.train(resume_from_checkpoint=str(tmp_path / "checkpoint-20"))
    resumed = again.model.state_dict()
    assert resumed.keys() == final.keys()
    different = [k for k in final if not torch.equal(final[k], resumed[k])]
    assert not different, different
    # recal's file carries the quantizer tensors, so the Trainer's model file does not (no "unexpected keys" flood)
    from safetensors.torch import load_file, save_file

    model_file = tmp_path / "checkpoint-20" / "model.safetensors"
    part = torch.load(tmp_path / "checkpoint-20" / "recal_state.pt", weights_only=True)
    assert not set(part["quantizer_tensors"]) & set(load_file(model_file))
    # a checkpoint written before recal_state.pt existed (recal's part in optimizer.pt, the quantizer tensors in
    # model.safetensors) resumes the same
    save_file({**load_file(model_file), **{k: v.contiguous() for k, v in part["quantizer_tensors"].items()}},
              model_file, metadata={"format": "pt"})
    (tmp_path / "checkpoint-20" / "recal_state.pt").unlink()
    older = _hf_trainer(tmp_path, RecalTrainerCallback(RECIPE))
    older.train(resume_from_checkpoint=str(tmp_path / "checkpoint-20"))
    assert [k for k in final if not torch.equal(final[k], older.model.state_dict()[k])] == []


class _RunsCode:
    def __reduce__(self):
        return (print, ("a crafted checkpoint ran code",))


def _hostile_recal_files(good: dict) -> dict:
    """What a broken or crafted ``recal_state.pt`` can be, each written by a function of its path."""
    tensors = good["quantizer_tensors"]
    scale = next(k for k in tensors if k.endswith("input_fake_quant.scale"))

    def with_tensors(changed):
        return lambda path: torch.save({**good, "quantizer_tensors": changed}, path)

    return {
        "a pickle that runs code": lambda path: torch.save({"x": _RunsCode()}, path),
        "a truncated file": lambda path: path.write_bytes(path.read_bytes()[:100]),
        "a list, not recal's state": lambda path: torch.save([1, 2], path),
        "no quantizer tensors": with_tensors({}),
        "a NaN scale": with_tensors({**tensors, scale: torch.full_like(tensors[scale], float("nan"))}),
        "another model's width": with_tensors({k: torch.cat([v, v]) if v.dim() else v for k, v in tensors.items()}),
        "recal's state of another recipe": lambda path: torch.save({**good, "recipe": "- !EpochRangeModifier "
                                                                    "{start_epoch: 0, end_epoch: 9}\n"}, path),
    }


def test_a_broken_recal_state_file_is_refused_naming_it(tmp_path, capsys):
    """Resuming a Trainer run from a ``recal_state.pt`` that is crafted, truncated, of another shape or holds a NaN
    scale: one ValueError that names the file, and no code run."""
    pytest.importorskip("accelerate")
    import shutil

    from recal_torch.integrations import RecalTrainerCallback

    _hf_trainer(tmp_path / "run", RecalTrainerCallback(RECIPE)).train()
    mine = tmp_path / "run" / "checkpoint-20" / "recal_state.pt"
    good = torch.load(mine, weights_only=True)
    for case, write in _hostile_recal_files(good).items():
        folder = tmp_path / case.replace(" ", "-").replace("'", "")
        shutil.copytree(tmp_path / "run", folder)
        write(folder / "checkpoint-20" / "recal_state.pt")
        trainer = _hf_trainer(folder, RecalTrainerCallback(RECIPE))
        with pytest.raises(ValueError) as refused:
            trainer.train(resume_from_checkpoint=str(folder / "checkpoint-20"))
        assert str(folder / "checkpoint-20" / "recal_state.pt") in str(refused.value), (case, str(refused.value))
    assert "ran code" not in capsys.readouterr().out


def test_the_trainer_resumes_recal_from_the_checkpoint_it_was_given_wherever_it_is(tmp_path):
    """``trainer.train(resume_from_checkpoint=PATH)`` with PATH outside ``output_dir`` (not set in TrainingArguments):
    recal's state comes from PATH. It raised FileNotFoundError; and with another run's ``checkpoint-20`` in
    ``output_dir`` (here one trained with another LR) that run's recal state could have been read instead."""
    pytest.importorskip("accelerate")
    import shutil

    from recal_torch.integrations import RecalTrainerCallback

    straight = _hf_trainer(tmp_path / "a", RecalTrainerCallback(RECIPE))
    straight.train()
    final = {k: v.clone() for k, v in straight.model.state_dict().items()}
    shutil.copytree(tmp_path / "a" / "checkpoint-20", tmp_path / "kept" / "checkpoint-20")
    other = _hf_trainer(tmp_path / "b", RecalTrainerCallback(RECIPE.replace("init_lr: 0.1", "init_lr: 0.05")))
    other.train()  # output_dir b now holds another run's checkpoint-20
    again = _hf_trainer(tmp_path / "b", RecalTrainerCallback(RECIPE))
    again.train(resume_from_checkpoint=str(tmp_path / "kept" / "checkpoint-20"))
    assert [k for k in final if not torch.equal(final[k], again.model.state_dict()[k])] == []


def _lightning_fit(folder, callback, resume=None):
    import lightning.pytorch as L
    from lightning.pytorch.callbacks import ModelCheckpoint

    class DigitsModule(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.body = nn.Sequential(nn.Flatten(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))

        def forward(self, x):
            return self.body(x)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return nn.functional.cross_entropy(self(x), y)

        def configure_optimizers(self):  # the user's own schedule: the recipe's LR modifiers take it over
            optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
            scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda k: 1 - k / 40)
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    torch.manual_seed(0)
    module = DigitsModule()
    data = [(d["pixels"], d["labels"]) for d in _digits()]
    loader = torch.utils.data.DataLoader(data, batch_size=BATCH, shuffle=False)
    trainer = L.Trainer(max_epochs=4, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                        log_every_n_steps=5,
                        enable_model_summary=False, default_root_dir=str(folder),
                        callbacks=[callback, ModelCheckpoint(dirpath=str(folder), save_top_k=-1, every_n_epochs=1)])
    trainer.fit(module, loader, ckpt_path=resume)
    return module, trainer


def test_lightning_runs_the_recipe_and_resumes_exactly(tmp_path):
    pytest.importorskip("lightning")
    from recal_torch.integrations import RecalLightningCallback

    callback = RecalLightningCallback(RECIPE)
    module, trainer = _lightning_fit(tmp_path, callback)
    final = {k: v.clone() for k, v in module.state_dict().items()}
    for layer in (module.body[1], module.body[3]):
        assert abs(float((layer.weight == 0).float().mean()) - 0.6) < 0.02
    assert any("scale" in k for k in final)
    # the module's own LambdaLR followed the recipe: 0.1 x 0.7 an epoch to epoch 3, then held (not 1 - k/40)
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.1 * 0.7 ** 2, rel=1e-9)
    assert trainer.lr_scheduler_configs[0].scheduler.get_last_lr()[0] == pytest.approx(0.049, rel=1e-9)
    assert not callback.manager.active
    assert callback.manager.step == 40
    assert trainer.callback_metrics["recal/lr"] == pytest.approx(0.049)  # logged at Lightning's logging steps

    checkpoint = sorted(tmp_path.glob("epoch=1-*.ckpt"))  # after epoch 2, QAT began at 1.5
    assert checkpoint, list(tmp_path.iterdir())
    again, _ = _lightning_fit(tmp_path / "again", RecalLightningCallback(RECIPE), resume=str(checkpoint[0]))
    resumed = again.state_dict()
    assert resumed.keys() == final.keys()
    different = [k for k in final if not torch.equal(final[k], resumed[k])]
    assert not different, different


def test_lightning_refuses_a_checkpoint_with_a_nan_scale_naming_it(tmp_path):
    """A Lightning checkpoint whose quantizer scale is NaN (a diverged run's): resuming is one ValueError naming the
    checkpoint's file and the tensor, not a run that trains on."""
    pytest.importorskip("lightning")
    from recal_torch.integrations import RecalLightningCallback

    _lightning_fit(tmp_path, RecalLightningCallback(RECIPE))
    checkpoint = sorted(tmp_path.glob("epoch=1-*.ckpt"))[0]
    saved = torch.load(checkpoint, weights_only=True)
    scale = next(k for k in saved["state_dict"] if k.endswith("input_fake_quant.scale"))
    saved["state_dict"][scale] = torch.full_like(saved["state_dict"][scale], float("nan"))
    torch.save(saved, tmp_path / "nan.ckpt")
    with pytest.raises(ValueError, match=rf"nan\.ckpt\): '{scale}' holds non-finite values"):
        _lightning_fit(tmp_path / "again", RecalLightningCallback(RECIPE), resume=str(tmp_path / "nan.ckpt"))


def test_a_tied_language_model_resumes_qat_from_the_trainers_safetensors(tmp_path):
    """GPT-2 ties its LM head to the token table, and the Trainer's safetensors save that tensor once: resuming in
    QAT loads it (the head is not "missing"), and the run ends as the uninterrupted one, bit for bit."""
    pytest.importorskip("accelerate")
    import transformers
    from transformers import Trainer, TrainingArguments

    from recal_torch.integrations import RecalTrainerCallback

    recipe = "- !EpochRangeModifier {start_epoch: 0, end_epoch: 2}\n- !QuantizationModifier {start_epoch: 0.5}\n"
    g = torch.Generator().manual_seed(0)
    data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 64, (32, 12), generator=g)]

    def run(resume=None):
        torch.manual_seed(0)
        config = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=1, n_head=2)
        args = TrainingArguments(output_dir=str(tmp_path), num_train_epochs=2, per_device_train_batch_size=8,
                                 learning_rate=1e-3, save_strategy="epoch", report_to="none", use_cpu=True, seed=0,
                                 disable_tqdm=True)
        trainer = Trainer(model=transformers.GPT2LMHeadModel(config), args=args, train_dataset=data,
                          callbacks=[RecalTrainerCallback(recipe)])
        trainer.train(resume_from_checkpoint=resume)
        return {k: v.clone() for k, v in trainer.model.state_dict().items()}

    straight = run()
    resumed = run(str(tmp_path / "checkpoint-4"))
    assert [k for k in straight if not torch.equal(straight[k], resumed[k])] == []


def test_learned_scales_resume_through_the_trainer(tmp_path):
    """Learned (lsq) scales train in param groups of recal's own, which the Trainer's freshly built optimizer lacks
    when it loads ``optimizer.pt`` (before any callback runs): the checkpoint keeps them apart from the user's groups,
    recal puts them (and their AdamW moments) back once the scales exist again, and the run ends bit for bit as the
    uninterrupted one."""
    pytest.importorskip("accelerate")
    from transformers import Trainer, TrainingArguments

    from recal_torch.integrations import RecalTrainerCallback

    recipe = ("- !EpochRangeModifier {start_epoch: 0, end_epoch: 4}\n"
              "- !QuantizationModifier {start_epoch: 1.5, scheme: {input_activations: {symmetric: false, observer: "
              "lsq}, weights: {observer: lsq, observer_kwargs: {lr_factor: 0.1}}}}\n")

    def run(resume=None):
        torch.manual_seed(0)
        args = TrainingArguments(output_dir=str(tmp_path), num_train_epochs=4, per_device_train_batch_size=BATCH,
                                 learning_rate=1e-3, optim="adamw_torch", save_strategy="epoch", report_to="none",
                                 use_cpu=True, seed=0, disable_tqdm=True, dataloader_num_workers=0)
        trainer = Trainer(model=DigitsNet(), args=args, train_dataset=_digits(), callbacks=[RecalTrainerCallback(recipe)])
        trainer.train(resume_from_checkpoint=resume)
        return trainer, {k: v.clone() for k, v in trainer.model.state_dict().items()}

    trainer, straight = run()
    groups = trainer.optimizer.param_groups  # the Trainer's two (decay, no decay), recal's two (one per LR factor)
    assert [g.get("recal_lr_factor") for g in groups] == [None, None, 0.1, 1.0]
    assert [g["initial_lr"] for g in groups] == pytest.approx([1e-3, 1e-3, 1e-4, 1e-3])  # the scheduler's bases
    saved = torch.load(tmp_path / "checkpoint-20" / "optimizer.pt", weights_only=True)
    assert len(saved["param_groups"]) == 2 and len(saved["recal"]["learned_groups"]["param_groups"]) == 2
    _, resumed = run(str(tmp_path / "checkpoint-20"))
    assert [k for k in straight if not torch.equal(straight[k], resumed[k])] == []


def test_learned_scales_resume_through_lightning(tmp_path):
    """The same in Lightning: the module's LambdaLR steps recal's groups too, and a checkpoint after QAT began
    resumes bit for bit."""
    pytest.importorskip("lightning")
    from recal_torch.integrations import RecalLightningCallback

    recipe = ("- !EpochRangeModifier {start_epoch: 0, end_epoch: 4}\n"
              "- !QuantizationModifier {start_epoch: 1.5, scheme: {input_activations: {symmetric: false, observer: "
              "lsq}, weights: {observer: lsq, observer_kwargs: {lr_factor: 0.1}}}}\n")
    module, trainer = _lightning_fit(tmp_path, RecalLightningCallback(recipe))
    final = {k: v.clone() for k, v in module.state_dict().items()}
    groups = trainer.optimizers[0].param_groups
    assert [g.get("recal_lr_factor") for g in groups] == [None, 0.1, 1.0]
    assert [g["initial_lr"] for g in groups] == pytest.approx([0.1, 0.01, 0.1])  # the LambdaLR's bases
    checkpoint = sorted(tmp_path.glob("epoch=1-*.ckpt"))
    again, _ = _lightning_fit(tmp_path / "again", RecalLightningCallback(recipe), resume=str(checkpoint[0]))
    assert [k for k in final if not torch.equal(final[k], again.state_dict()[k])] == []


def _launch(out, *options, run: str = "tests.support.trainer_launch_run") -> list[dict]:
    """``run`` in two processes (``torchrun``, the launcher ``accelerate launch`` runs for several devices); each
    rank's record."""
    import os
    import subprocess
    import sys

    from tests.support.paths import ROOT
    from tests.support.hang_guard import LAUNCH_SECONDS

    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    # --standalone: a free port of its own (two launches at once in the suite would share torchrun's default)
    launch = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                               "-m", run, str(out), *options], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    try:
        _, stderr = launch.communicate(timeout=LAUNCH_SECONDS)
    except subprocess.TimeoutExpired:
        launch.terminate()  # torchrun ends its ranks (each in a session of its own) on SIGTERM; a SIGKILL orphans them
        try:
            _, stderr = launch.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            launch.kill()
            _, stderr = launch.communicate()
        pytest.fail(f"{run} {' '.join(options)} still ran after {LAUNCH_SECONDS:.0f} s; its ranks' stacks (the "
                    f"dump half a minute before) and output:\n{stderr[-12000:]}")
    assert launch.returncode == 0, stderr[-3000:]
    resumed = ".resumed" if any(o.startswith("resume=") for o in options) else ""
    return [torch.load(out / f"rank{r}{resumed}.pt", weights_only=False) for r in (0, 1)]


@pytest.mark.slow
def test_the_trainer_callback_under_ddp_and_fsdp2_in_two_launched_processes(tmp_path):
    """The Trainer in two processes, pruning then QAT through the callback. DDP (a CPU run's default): every rank
    the same weights, masks and observed ranges (observers reduce across ranks). The Trainer's FSDP2 (every block,
    the tied embedding and LM head as one unit, the model): QAT takes over the layers FSDP sharded on their own in
    place, the run ends where the DDP run does, and a checkpoint taken during QAT resumes bit for bit, distributed
    (``SHARDED_STATE_DICT``) or whole (learned scales included)."""
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    ranks = _launch(tmp_path / "ddp")
    assert [r["world"] for r in ranks] == [2, 2] and "MULTI_CPU" in ranks[0]["distributed"]
    state = ranks[0]["state"]
    assert any(k.endswith("activation_post_process.scale") for k in state), "QAT layers in place"
    for key, value in state.items():
        assert torch.equal(value, ranks[1]["state"][key]), key
    for layer in (0, 1):
        weight = state[f"transformer.h.{layer}.mlp.c_fc.weight"]
        assert abs(float((weight == 0).float().mean()) - 0.5) < 0.01

    sharded = _launch(tmp_path / "fsdp", "fsdp", "sharded")  # distributed checkpoints
    classes = sharded[0]["classes"]
    assert classes[""] == "FSDPGPT2LMHeadModel" and classes["transformer.h.0"] == "FSDPGPT2Block"
    assert classes["transformer.wte"] == "FSDPQATEmbedding" and classes["lm_head"] == "FSDPQATTorchLinear"
    assert sharded[0]["state"].keys() == state.keys()
    for key, value in state.items():
        assert torch.equal(sharded[0]["state"][key], sharded[1]["state"][key]), key
        torch.testing.assert_close(sharded[0]["state"][key], value, rtol=1e-4, atol=1e-5,
                                   msg=lambda m, key=key: f"{key}: {m}")

    again = _launch(tmp_path / "fsdp", "fsdp", "sharded", f"resume={tmp_path / 'fsdp' / 'checkpoint-6'}")
    for before, after in zip(sharded, again):
        assert [k for k in before["state"] if not torch.equal(before["state"][k], after["state"][k])] == []

    learned = _launch(tmp_path / "lsq", "fsdp", "lsq")  # whole-model files
    saved = torch.load(tmp_path / "lsq" / "checkpoint-6" / "recal_state.pt", weights_only=True)
    assert saved["learned_groups"]["param_groups"] and saved["quantizer_tensors"]  # taken during QAT
    again = _launch(tmp_path / "lsq", "fsdp", "lsq", f"resume={tmp_path / 'lsq' / 'checkpoint-6'}")
    for before, after in zip(learned, again):
        assert [k for k in before["state"] if not torch.equal(before["state"][k], after["state"][k])] == []


@pytest.mark.slow
def test_the_lightning_callback_under_fsdp2_in_two_launched_processes(tmp_path):
    """Lightning's FSDP2 (``ModelParallelStrategy``, every layer and the module sharded in ``configure_model``):
    QAT takes the sharded layers over in place, learned scales average their gradients over the ranks (Lightning
    steps with a closure: recal readies the gradients once the closure made them), and a distributed checkpoint
    taken during QAT, which keeps only the optimizer's own keys, resumes bit for bit from recal's part beside it."""
    pytest.importorskip("lightning")
    straight = _launch(tmp_path, run="tests.support.lightning_launch_run")
    assert straight[0]["classes"] == ["Flatten", "FSDPQATTorchLinear", "Identity", "FSDPQATTorchLinear"]
    state = straight[0]["state"]
    assert any(k.endswith("weight_fake_quant.scale") for k in state)
    assert [k for k in state if not torch.equal(state[k], straight[1]["state"][k])] == []  # the ranks agree
    assert abs(float((state["body.1.weight"] == 0).float().mean()) - 0.5) < 0.01
    resumed = _launch(tmp_path, f"resume={tmp_path / 'epoch=1-step=20.ckpt'}", run="tests.support.lightning_launch_run")
    for before, after in zip(straight, resumed):
        assert [k for k in before["state"] if not torch.equal(before["state"][k], after["state"][k])] == []
