"""Lightning under a recipe: ``Trainer(callbacks=[RecalLightningCallback("recipe.yaml")])``.

Lightning keeps its loop, precision, checkpoints and loggers. At ``on_fit_start`` (after ``configure_optimizers``)
the callback binds the recipe to the LightningModule, its one optimizer and the scheduler if any (which then
follows a recipe that sets the LR), with one optimizer step as the recipe's step. recal's part of a checkpoint
rides in the optimizer's state that Lightning saves; on resume Lightning restores it through recal's hook, and the
quantizer tensors of the checkpoint go in once QAT has re-created its layers (``on_train_start``), so the module
is loaded non-strictly by Lightning and strictly by recal. A distributed checkpoint (``ModelParallelStrategy``,
FSDP2) keeps only the optimizer's own keys and the module's float tensors: recal's state and quantizer tensors go
in the checkpoint beside them, and come back at ``on_train_start``. recal's scalars (sparsity, LR, QAT state) are
logged with ``LightningModule.log_dict`` at Lightning's logging steps (``log_every_n_steps``). At the end of
fitting the recipe is finalized.
"""

from __future__ import annotations

import math
import os
from typing import Any

import torch
from lightning.pytorch import Callback

from ..manager import ScheduledModifierManager
from ..optimizer_hooks import RECAL_STATE_KEY
from .session import check_length, load_model_state, manager_of, recal_part, restore_recal_part


class RecalLightningCallback(Callback):
    """Apply a recal recipe to a Lightning ``Trainer.fit`` run.

    Args:
        recipe: the recipe (a path or YAML text), or a :class:`~recal_torch.ScheduledModifierManager`.
        teacher: the model a DistillationModifier distils from (add ``callback.manager.loss(...)`` to your
            ``training_step``'s loss).
        quantize_attention: also quantize the attention matmuls (see the PyTorch page).
        example_inputs: inputs to trace the model with when structured pruning needs ``torch.export``.
        log_scalars: log recal's scalars (``recal/...``) at Lightning's logging steps.
    """

    def __init__(self, recipe: str | os.PathLike | ScheduledModifierManager, *, teacher: torch.nn.Module | None = None,
                 quantize_attention: bool = False, example_inputs: Any = None, log_scalars: bool = True):
        self.manager = manager_of(recipe)
        self._options = {"teacher": teacher, "quantize_attention": quantize_attention,
                         "example_inputs": example_inputs}
        self._log_scalars = log_scalars
        self._resumed: dict[str, torch.Tensor] | None = None
        self._recal_state: dict[str, Any] | None = None

    def setup(self, trainer, pl_module, stage: str) -> None:
        if stage == "fit":  # a checkpoint taken during QAT holds quantizer tensors the float module lacks until the
            pl_module.strict_loading = False  # recipe re-creates them; recal loads them strictly (on_train_start)

    def on_save_checkpoint(self, trainer, pl_module, checkpoint: dict[str, Any]) -> None:
        if not self.manager.active:
            return
        # a distributed checkpoint (ModelParallelStrategy's FSDP2) keeps only the optimizer's own keys and loads
        # the module's tensors into the float module: recal's state and quantizer tensors ride beside them
        if not any(RECAL_STATE_KEY in state for state in checkpoint.get("optimizer_states", [])):
            checkpoint[RECAL_STATE_KEY] = recal_part(trainer.optimizers[0], pl_module)

    def on_load_checkpoint(self, trainer, pl_module, checkpoint: dict[str, Any]) -> None:
        self._resumed = checkpoint.get("state_dict")
        self._recal_state = checkpoint.get(RECAL_STATE_KEY)

    def on_fit_start(self, trainer, pl_module) -> None:
        if len(trainer.optimizers) != 1:
            raise ValueError(f"a recipe drives one optimizer; configure_optimizers returned {len(trainer.optimizers)}")
        configs = trainer.lr_scheduler_configs
        if len(configs) > 1:
            raise ValueError(f"a recipe drives one optimizer and its scheduler; there are {len(configs)} schedulers")
        total = trainer.estimated_stepping_batches  # sets up the training data, so its length is known
        steps_per_epoch = max(math.ceil(trainer.num_training_batches / trainer.accumulate_grad_batches), 1)
        self.manager.modify(pl_module, trainer.optimizers[0], steps_per_epoch,
                            lr_scheduler=configs[0].scheduler if configs else None, **self._options)
        check_length(self.manager, total / steps_per_epoch, "the Lightning Trainer")

    def on_train_start(self, trainer, pl_module) -> None:
        # Lightning restored the optimizer (and, through recal's hook, the recipe's state) after on_fit_start
        where = f"the checkpoint Lightning resumed from ({trainer.ckpt_path})" if trainer.ckpt_path else \
            "the checkpoint Lightning resumed from"
        if self._recal_state is not None:  # not through the hook: a distributed checkpoint
            optimizer = trainer.optimizers[0]
            restore_recal_part(optimizer, optimizer.state_dict(), self._recal_state, self.manager, pl_module, where)
        elif self._resumed is not None and self.manager.qat.prepared:
            load_model_state(pl_module, self._resumed, where)
        self._resumed = self._recal_state = None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        # only on the steps Lightning writes to its loggers: the scalars measure every pruned weight's zeros (on a
        # sharded model, gathered), work a step between logs should not pay
        if self._log_scalars and self.manager.active and trainer.global_step % trainer.log_every_n_steps == 0:
            pl_module.log_dict({f"recal/{k}": v for k, v in self.manager.scalars().items()}, on_step=True,
                               on_epoch=False)

    def on_fit_end(self, trainer, pl_module) -> None:
        if self.manager.active:
            self.manager.finalize(pl_module)
