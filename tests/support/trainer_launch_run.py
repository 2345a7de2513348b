"""A recipe (pruning, then QAT) through the Hugging Face Trainer in two processes, as ``accelerate launch`` starts it,
for :mod:`tests.torch.test_integrations`: ``accelerate launch --cpu --num_processes 2 -m tests.support.trainer_launch_run OUT
[fsdp] [sharded] [lsq] [resume=CHECKPOINT]``. Each rank saves its masks, QAT observers and whole weights to
``OUT/rank<r>.pt`` (``rank<r>.resumed.pt`` when resumed). ``lsq`` learns the quantizers' scales; ``sharded`` has FSDP write
distributed checkpoints (``SHARDED_STATE_DICT``) rather than whole-model files.

With ``fsdp``, the run also checkpoints every 6 steps, and the Trainer's own FSDP2 (``fsdp="full_shard
auto_wrap"``, ``fsdp_version: 2``) shards the model as on GPUs: each GPT-2 block, the embeddings and LM head as one
unit of their own, the model. accelerate turns FSDP on only for accelerator devices, so here its state is switched
to FSDP after it chose multi-CPU (:func:`_fsdp_on_cpu`); FSDP2 itself runs on CPUs with gloo."""

from __future__ import annotations

import os
import sys

import torch

RECIPE = r"""
- !EpochRangeModifier {start_epoch: 0, end_epoch: 2}
- !GMPruningModifier {params: ['re:.*mlp\.c_fc\.weight'], init_sparsity: 0.2, final_sparsity: 0.5, start_epoch: 0,
                      end_epoch: 1, update_frequency: 0.5}
- !QuantizationModifier {start_epoch: 1}
"""
LSQ = """
  scheme: {input_activations: {symmetric: false, observer: lsq},
           weights: {observer: lsq, observer_kwargs: {lr_factor: 0.1}}}
"""


class _Tokens(torch.utils.data.Dataset):
    def __init__(self):
        self.ids = torch.randint(0, 64, (32, 16), generator=torch.Generator().manual_seed(0))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _fsdp_on_cpu() -> None:
    """Let accelerate prepare the model with FSDP2 on CPUs, as it does on GPUs (its state otherwise says MULTI_CPU
    and runs DDP even with an FSDP plugin)."""
    import accelerate.state
    from accelerate.utils import DistributedType

    init = accelerate.state.AcceleratorState.__init__

    def with_fsdp(self, *args, fsdp_plugin=None, **kwargs):
        init(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
        if fsdp_plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
            self.distributed_type, self.fsdp_plugin = DistributedType.FSDP, fsdp_plugin
            # every later AcceleratorState() copies the process state's type over its own
            accelerate.state.PartialState._shared_state["distributed_type"] = DistributedType.FSDP

    accelerate.state.AcceleratorState.__init__ = with_fsdp


def main(out: str, fsdp: bool = False, sharded: bool = False, lsq: bool = False, resume: str | None = None) -> None:
    import transformers
    from transformers import Trainer, TrainingArguments

    from recal_torch.integrations import RecalTrainerCallback

    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2, bos_token_id=0,
                                     eos_token_id=0)
    model = transformers.GPT2LMHeadModel(config)
    args = TrainingArguments(output_dir=out, per_device_train_batch_size=4, num_train_epochs=2, learning_rate=1e-3,
                             use_cpu=True, report_to=[], save_strategy="steps" if fsdp else "no", save_steps=6,
                             logging_steps=100, seed=0,
                             **({"fsdp": "full_shard auto_wrap", "fsdp_config": {
                                 "fsdp_version": 2, "transformer_layer_cls_to_wrap": ["GPT2Block"],
                                 **({"state_dict_type": "SHARDED_STATE_DICT"} if sharded else {})}} if fsdp else {}))
    if fsdp:
        _fsdp_on_cpu()
    callback = RecalTrainerCallback(RECIPE.replace("{start_epoch: 1}", "\n  start_epoch: 1" + LSQ) if lsq else RECIPE)
    trainer = Trainer(model=model, args=args, train_dataset=_Tokens(), callbacks=[callback])
    trainer.train(resume_from_checkpoint=resume)
    rank = trainer.args.process_index
    state = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
             for k, v in trainer.model.state_dict().items()}
    torch.save({"world": trainer.args.world_size, "distributed": str(trainer.accelerator.distributed_type),
                "classes": {n: type(m).__name__ for n, m in trainer.model.named_modules()},
                "masks": {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).clone()
                          for k, v in callback.manager.masks.effective.items()},
                "state": state}, os.path.join(out, f"rank{rank}{'.resumed' if resume else ''}.pt"))
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()  # a process group left to the exit can abort it (gloo's threads)


if __name__ == "__main__":
    from tests.support.hang_guard import guard_launched_rank

    guard_launched_rank()  # a native abort or a hang prints where each thread was
    options = sys.argv[2:]
    main(sys.argv[1], fsdp="fsdp" in options, sharded="sharded" in options, lsq="lsq" in options,
         resume=next((o.split("=", 1)[1] for o in options if o.startswith("resume=")), None))
    # the record is written and the process group ended: leave without the interpreter's teardown, whose native
    # destructors (gloo's threads) aborted a finished run twice in a loaded full suite
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
