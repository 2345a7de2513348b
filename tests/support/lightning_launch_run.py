"""A recipe (pruning, then QAT with learned scales) through Lightning's FSDP2 strategy (``ModelParallelStrategy``:
the module's ``configure_model`` calls ``fully_shard``) in two processes, for :mod:`tests.torch.test_integrations`:
``torchrun --nproc_per_node 2 -m tests.support.lightning_launch_run OUT [resume=CHECKPOINT]``. Each layer is sharded on its
own, then the module; Lightning writes distributed checkpoints (a folder per epoch). Each rank saves its whole
tensors and layer classes to ``OUT/rank<r>.pt`` (``rank<r>.resumed.pt`` when resumed)."""

from __future__ import annotations

import os
import sys

import torch
from torch import nn

RECIPE = r"""
- !EpochRangeModifier {start_epoch: 0, end_epoch: 4}
- !GMPruningModifier {params: ['re:body\.1\.weight'], init_sparsity: 0.2, final_sparsity: 0.5, start_epoch: 0,
                      end_epoch: 2, update_frequency: 0.5}
- !QuantizationModifier
  start_epoch: 1.5
  scheme: {input_activations: {symmetric: false, observer: lsq},
           weights: {observer: lsq, observer_kwargs: {lr_factor: 0.01}}}
"""


def main(out: str, resume: str | None = None) -> None:
    import lightning.pytorch as L
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.strategies import ModelParallelStrategy

    from recal_torch.integrations import RecalLightningCallback

    class Digits(L.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.body = nn.Sequential(nn.Flatten(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))

        def configure_model(self):
            from torch.distributed.fsdp import fully_shard

            mesh = self.device_mesh["data_parallel"]
            for layer in (self.body[1], self.body[3], self):
                fully_shard(layer, mesh=mesh)

        def forward(self, x):
            return self.body(x)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return nn.functional.cross_entropy(self(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(8, 8, generator=g), int(torch.randint(0, 10, (1,), generator=g))) for _ in range(160)]
    module = Digits()
    trainer = L.Trainer(max_epochs=4, accelerator="cpu", devices=2, logger=False, enable_progress_bar=False,
                        strategy=ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1),
                        enable_model_summary=False, default_root_dir=out,
                        callbacks=[RecalLightningCallback(RECIPE),
                                   ModelCheckpoint(dirpath=out, save_top_k=-1, every_n_epochs=1)])
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=8, shuffle=False), ckpt_path=resume)
    state = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
             for k, v in module.state_dict().items()}
    torch.save({"state": state, "classes": [type(m).__name__ for m in module.body]},
               os.path.join(out, f"rank{trainer.global_rank}{'.resumed' if resume else ''}.pt"))
    torch.distributed.destroy_process_group()  # a process group left to the exit can abort it (gloo's threads)


if __name__ == "__main__":
    from tests.support.hang_guard import guard_launched_rank

    guard_launched_rank()  # a native abort or a hang prints where each thread was
    main(sys.argv[1], resume=next((o.split("=", 1)[1] for o in sys.argv[2:] if o.startswith("resume=")), None))
    # the record is written and the process group ended: leave without the interpreter's teardown, whose native
    # destructors (gloo's threads) aborted a finished run twice in a loaded full suite
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
