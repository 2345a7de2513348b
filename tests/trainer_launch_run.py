"""A recipe (pruning, then QAT) through the Hugging Face Trainer in two processes, as ``accelerate launch`` starts it,
for :mod:`tests.test_integrations`: ``accelerate launch --cpu --num_processes 2 -m tests.trainer_launch_run OUT``.
Each rank saves its masks, QAT observers and weights to ``OUT/rank<r>.pt``."""

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


class _Tokens(torch.utils.data.Dataset):
    def __init__(self):
        self.ids = torch.randint(0, 64, (32, 16), generator=torch.Generator().manual_seed(0))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def main(out: str) -> None:
    import transformers
    from transformers import Trainer, TrainingArguments

    from recal_torch.integrations import RecalTrainerCallback

    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2, bos_token_id=0,
                                     eos_token_id=0)
    model = transformers.GPT2LMHeadModel(config)
    args = TrainingArguments(output_dir=out, per_device_train_batch_size=4, num_train_epochs=2, learning_rate=1e-3,
                             use_cpu=True, report_to=[], save_strategy="no", logging_steps=100, seed=0)
    callback = RecalTrainerCallback(RECIPE)
    trainer = Trainer(model=model, args=args, train_dataset=_Tokens(), callbacks=[callback])
    trainer.train()
    rank = trainer.args.process_index
    state = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
    torch.save({"world": trainer.args.world_size, "distributed": str(trainer.accelerator.distributed_type),
                "masks": {k: v.clone() for k, v in callback.manager.masks.effective.items()},
                "state": state}, os.path.join(out, f"rank{rank}.pt"))


if __name__ == "__main__":
    main(sys.argv[1])
