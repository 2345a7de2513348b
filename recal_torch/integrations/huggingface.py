"""The Hugging Face ``Trainer`` under a recipe: ``Trainer(..., callbacks=[RecalTrainerCallback("recipe.yaml")])``.

The Trainer keeps its loop, gradient accumulation, mixed precision, checkpoints and logs. At ``on_train_begin``
(the optimizer, its scheduler and the data exist) the callback binds the recipe to them, with one optimizer step
as the recipe's step; a recipe that sets the LR makes the Trainer's scheduler follow it, so the logged LR is the
one each step used. recal's part of a checkpoint, with the quantizer tensors, is the checkpoint folder's
``recal_state.pt`` (FSDP's optimizer files keep only the optimizer's own keys); a resumed run reads it back and
puts the quantizer tensors in once QAT has re-created its layers. Each log record gains recal's scalars (sparsity,
QAT state). At ``on_train_end`` the recipe is finalized: masks baked in, QAT observers frozen, the model ready for
:func:`recal_torch.export_onnx`.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import torch
from transformers import TrainerCallback

from recal_core.atomic import atomic_path

from ..checkpoint_file import read_checkpoint_file
from ..manager import ScheduledModifierManager
from ..optimizer_hooks import RECAL_STATE_KEY
from .session import (QUANTIZER_KEY, check_length, inner, load_model_state, manager_of, read_recal_part,
                      recal_part, restore_recal_part)

RECAL_FILE = "recal_state.pt"  # in each checkpoint folder: recal's state, learned scales' groups, quantizer tensors
FSDP_MODEL_FILE = "pytorch_model_fsdp.bin"  # accelerate's whole state dict of an FSDP model (its default)


class RecalTrainerCallback(TrainerCallback):
    """Apply a recal recipe to a Hugging Face ``Trainer`` run.

    Args:
        recipe: the recipe (a path or YAML text), or a :class:`~recal_torch.ScheduledModifierManager`.
        teacher: the model a DistillationModifier distils from (its loss is added in ``compute_loss`` by you:
            ``loss = callback.manager.loss(loss, inputs, outputs)``).
        quantize_attention: also quantize the attention matmuls (see the PyTorch page).
        example_inputs: inputs to trace the model with when structured pruning needs ``torch.export``.
    """

    def __init__(self, recipe: str | os.PathLike | ScheduledModifierManager, *, teacher: torch.nn.Module | None = None,
                 quantize_attention: bool = False, example_inputs: Any = None):
        self.manager = manager_of(recipe)
        self._step_lrs: list[float] = []  # each param group's LR at the last optimizer step
        self._options = {"teacher": teacher, "quantize_attention": quantize_attention,
                         "example_inputs": example_inputs}

    def on_train_begin(self, args, state, control, model=None, optimizer=None, lr_scheduler=None,
                       train_dataloader=None, **kwargs):
        batches = len(train_dataloader)
        steps_per_epoch = max(math.ceil(batches / args.gradient_accumulation_steps), 1)
        # what the Trainer (or FSDP) restored, before the recipe sets its step-0 values: the user's groups
        loaded = inner(optimizer).state_dict() if state.global_step > 0 else None
        self.manager.modify(model, inner(optimizer), steps_per_epoch, lr_scheduler=inner(lr_scheduler),
                            **self._options)
        check_length(self.manager, state.max_steps / steps_per_epoch, "the Trainer")
        if loaded is not None:
            self._resume(args, state, model, inner(optimizer), loaded)

    def on_save(self, args, state, control, model=None, optimizer=None, **kwargs):
        if not self.manager.active:
            return
        mine = recal_part(inner(optimizer), model)  # on every rank; every rank then holds the same state
        if state.is_world_process_zero:
            folder = Path(args.output_dir) / f"checkpoint-{state.global_step}"
            with atomic_path(folder / RECAL_FILE) as tmp:
                torch.save(mine, tmp)
            _drop_from_torch_file(folder / FSDP_MODEL_FILE, set(mine[QUANTIZER_KEY]))
            _drop_from_model_files(folder, set(mine[QUANTIZER_KEY]))

    def _resume(self, args, state, model, optimizer: torch.optim.Optimizer, loaded: dict[str, Any]) -> None:
        """The Trainer restored the weights and the optimizer (the user's param groups, ``loaded``) before recal was
        back: recal's state from its file (QAT layers re-created, the learned scales' param groups with their state),
        then the quantizer tensors into those layers."""
        folder = Path(_resumed_from() or args.resume_from_checkpoint
                      or Path(args.output_dir) / f"checkpoint-{state.global_step}")
        mine, plain = folder / RECAL_FILE, folder / "optimizer.pt"
        if mine.is_file():
            restore_recal_part(optimizer, loaded, read_recal_part(mine), self.manager, model, str(mine))
            return
        if not plain.is_file():
            raise FileNotFoundError(f"the Trainer resumed at step {state.global_step}, but recal finds no {mine} to "
                                    "read its state from: set TrainingArguments(resume_from_checkpoint=<folder>) to "
                                    "the checkpoint you resume from")
        optimizer_state = read_checkpoint_file(plain)  # saved before recal_state.pt
        if not isinstance(optimizer_state, dict) or RECAL_STATE_KEY not in optimizer_state:
            raise ValueError(f"{plain} holds no recal state: it was not saved under this callback")
        try:
            optimizer.load_state_dict(optimizer_state)
        except (ValueError, TypeError, KeyError, RuntimeError) as exc:  # the manager's and torch's, naming no file
            raise ValueError(f"{plain}: recal's state in it does not resume this run: {exc}") from exc
        if self.manager.qat.prepared:
            load_model_state(model, _model_tensors(folder), str(folder))

    def on_pre_optimizer_step(self, args, state, control, optimizer=None, **kwargs):
        if optimizer is not None:  # the LRs this step trains with (after it, recal has set the next step's)
            self._step_lrs = [float(group["lr"]) for group in optimizer.param_groups]

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs is not None and self.manager.active:
            scalars = {f"recal/{k}": v for k, v in self.manager.scalars().items()}
            for i, lr in enumerate(self._step_lrs):  # the step just taken's, as the Trainer logs it
                key = "recal/lr" + ("" if i == 0 else f"/group{i}")
                if key in scalars:
                    scalars[key] = lr
            logs.update(scalars)
            if state.log_history:
                state.log_history[-1].update(scalars)

    def on_train_end(self, args, state, control, model=None, **kwargs):
        if self.manager.active:
            self.manager.finalize(model)


def _resumed_from() -> str | None:
    """The checkpoint folder ``Trainer.train(resume_from_checkpoint=...)`` is resuming from. The Trainer keeps it in
    a local of its training loop, not in ``TrainingArguments`` or the state it gives callbacks: read from that frame
    (its own variable, already resolved from ``True`` to the last checkpoint), so that a checkpoint outside
    ``output_dir`` resumes, and another run's ``checkpoint-<step>`` in ``output_dir`` is never read instead."""
    import inspect

    frame = inspect.currentframe()
    try:
        while frame is not None:
            if frame.f_code.co_name == "_inner_training_loop" and "transformers" in frame.f_code.co_filename:
                found = frame.f_locals.get("resume_from_checkpoint")
                return found if isinstance(found, (str, os.PathLike)) else None
            frame = frame.f_back
        return None
    finally:
        del frame


def _drop_from_torch_file(path: Path, names: set[str]) -> None:
    """The tensors ``names`` (the quantizer tensors, kept in recal's file) leave a ``torch.save`` state dict file, read
    memory-mapped (only their bytes are read and held): FSDP's whole-model file, which it loads into the float model
    before recal is back and which refuses a key the model lacks, and ``pytorch_model.bin``."""
    if names and path.is_file():
        saved = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        if names & saved.keys():
            with atomic_path(path) as tmp:
                torch.save({k: v for k, v in saved.items() if k not in names}, tmp)


def _drop_from_model_files(folder: Path, names: set[str]) -> None:
    """The quantizer tensors leave the Trainer's model files (``model*.safetensors`` with its index, or
    ``pytorch_model.bin``): they are in recal's file, and left there the Trainer's resume, which loads them into the
    float model, warned of each as an unexpected key (86 lines for a small decoder)."""
    import json

    from safetensors import safe_open
    from safetensors.torch import save_file

    if not names:
        return
    for shard in sorted(folder.glob("model*.safetensors")):
        with safe_open(str(shard), "pt") as f:
            keys, metadata = list(f.keys()), f.metadata()
            if not names & set(keys):
                continue
            kept = {k: f.get_tensor(k) for k in keys if k not in names}
        with atomic_path(shard) as tmp:
            save_file(kept, str(tmp), metadata=metadata)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        data = json.loads(index.read_text())
        data["weight_map"] = {k: v for k, v in data.get("weight_map", {}).items() if k not in names}
        with atomic_path(index) as tmp:
            Path(tmp).write_text(json.dumps(data, indent=2))
    _drop_from_torch_file(folder / "pytorch_model.bin", names)


def _model_tensors(folder: Path) -> dict[str, torch.Tensor]:
    """The model tensors of a Trainer checkpoint: safetensors (one file or shards), else ``pytorch_model.bin``."""
    shards = sorted(folder.glob("model*.safetensors"))
    if shards:
        from safetensors.torch import load_file

        return {k: v for shard in shards for k, v in load_file(str(shard)).items()}
    binary = folder / "pytorch_model.bin"
    if binary.is_file():
        return read_checkpoint_file(binary)
    raise FileNotFoundError(f"{folder} holds no model.safetensors or pytorch_model.bin to resume QAT's tensors from")
