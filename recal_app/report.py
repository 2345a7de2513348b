"""What a recipe will do, epoch by epoch: the table ``recal check`` prints and the curves it plots."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from recal_core import modifiers as M
from recal_core.atomic import atomic_path
from recal_core.schedule import RecipeSchedule


@dataclass(frozen=True)
class EpochRow:
    epoch: int
    step: int
    sparsity: tuple[float | None, ...]  # one per pruning modifier
    lr: float | None
    lr_relative: bool  # lr is a multiple of the optimizer's own LR
    weight_decay: float | None
    qat: str
    trainable: str


def _lr(schedule: RecipeSchedule, k: int) -> tuple[float | None, bool]:
    if schedule.needs_base_lr():
        return schedule.lr(k, base_lr=1.0), True
    return schedule.lr(k), False


MAX_TABLE_EPOCHS = 200  # rows of `recal check`'s table beyond the modifiers' own start and end epochs


def table_epochs(schedule: RecipeSchedule) -> list[int]:
    """Every epoch of a run up to :data:`MAX_TABLE_EPOCHS` long; of a longer one, evenly spaced epochs plus each
    modifier's start and end, so the table grows with the recipe, not with its epoch numbers."""
    last = schedule.recipe.max_epochs
    if last <= MAX_TABLE_EPOCHS:
        return list(range(last + 1))
    stride = -(-last // MAX_TABLE_EPOCHS)
    marks = set(range(0, last + 1, stride)) | {last}
    for m in schedule.recipe.modifiers:
        for epoch in (getattr(m, "start_epoch", None), getattr(m, "end_epoch", None)):
            if isinstance(epoch, (int, float)) and 0 <= epoch <= last:
                marks.add(int(epoch))
    return sorted(marks)


def epoch_rows(schedule: RecipeSchedule) -> list[EpochRow]:
    """One row per epoch start (after ``epoch * steps_per_epoch`` steps) of :func:`table_epochs`."""
    rows = []
    for epoch in table_epochs(schedule):
        k = schedule.step(epoch)
        lr, relative = _lr(schedule, k)
        qat = []
        for i, _ in schedule.quantization:
            state = schedule.qat(i, k)
            if state.enabled:
                flags = [f for f, on in (("bn-frozen", state.bn_frozen), ("obs-frozen", state.observers_frozen)) if on]
                qat.append("on" + (f" ({', '.join(flags)})" if flags else ""))
            else:
                qat.append("off")
        rules = schedule.trainable_rules(k)
        trainable = "; ".join(f"{_spec(m.params)}={'train' if m.trainable else 'frozen'}" for _, m in rules)
        rows.append(EpochRow(
            epoch, k,
            tuple((None if p.constant else p.sparsity(k)) for p in schedule.pruning),
            lr, relative, schedule.weight_decay(k), " ".join(qat) or "-", trainable or "-",
        ))
    return rows


def _spec(params: M.ParamSpec) -> str:
    text = params if isinstance(params, str) else ",".join(params)
    return text if len(text) <= 24 else text[:21] + "..."


def format_table(schedule: RecipeSchedule) -> str:
    """A fixed-width text table of :func:`epoch_rows`, with a legend of the pruning columns."""
    rows = epoch_rows(schedule)
    recipe = schedule.recipe
    prune_heads = []
    legend = []
    for n, p in enumerate(schedule.pruning, 1):
        head = f"P{n}"
        prune_heads.append(head)
        if p.constant:
            what = "keeps zeros"
        elif isinstance(p.modifier, M.ACDCPruningModifier):
            what = f"AC/DC {p.modifier.compression_sparsity:g} in alternate phases"
        else:
            what = f"{p.modifier.init_sparsity:g}->{p.modifier.final_sparsity:g}"
        legend.append(f"  {head}: {recipe.describe(p.index)} params={_spec(p.modifier.params)} {what}")
    heads = ["epoch", "step", *prune_heads, "lr", "weight_decay", "qat", "trainable"]
    relative = any(r.lr_relative for r in rows)
    table = []
    for r in rows:
        sparsities = []
        for p, value in zip(schedule.pruning, r.sparsity):
            if p.constant:
                sparsities.append("keep" if p.mask_in_force(r.step) else "-")
            else:
                sparsities.append("-" if value is None else f"{value:.4f}")
        lr = "-" if r.lr is None else (f"x{r.lr:.4g}" if r.lr_relative else f"{r.lr:.4g}")
        wd = "-" if r.weight_decay is None else f"{r.weight_decay:g}"
        table.append([str(r.epoch), str(r.step), *sparsities, lr, wd, r.qat, r.trainable])
    widths = [max(len(h), *(len(row[c]) for row in table)) for c, h in enumerate(heads)]
    lines = [f"recipe {recipe.source}: {len(recipe.modifiers)} modifiers, max_epochs={recipe.max_epochs}, "
             f"steps_per_epoch={schedule.steps_per_epoch}, total_steps={schedule.total_steps}",
             "values in force after the given number of optimizer steps ('-': not set by the recipe)"]
    if legend:
        lines += ["pruning columns (target sparsity):", *legend]
    if relative:
        lines.append("lr 'xF': F times the optimizer's own learning rate (no init_lr given)")
    if len(rows) < recipe.max_epochs + 1:
        lines.append(f"{len(rows)} of {recipe.max_epochs + 1} epochs shown: evenly spaced, and every modifier's "
                     "start and end")
    lines.append("  ".join(h.rjust(w) for h, w in zip(heads, widths)))
    lines += ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in table]
    return "\n".join(lines)


MAX_PLOT_POINTS = 4000
MAX_PLOT_CURVES = 12  # pruning targets drawn; a legend of hundreds is unreadable and slow


def sample_steps(schedule: RecipeSchedule) -> list[int]:
    """The steps a plot draws: every step of a short run; for a long one, evenly spaced steps plus every
    epoch start and every mask update near them, so memory does not grow with the number of steps."""
    total = schedule.total_steps
    if total + 1 <= MAX_PLOT_POINTS:
        return list(range(total + 1))
    stride = -(-(total + 1) // MAX_PLOT_POINTS)
    marks = set(range(0, total + 1, stride)) | {total}
    if schedule.recipe.max_epochs < MAX_PLOT_POINTS:
        marks |= {min(total, schedule.step(e)) for e in range(schedule.recipe.max_epochs + 1)}
    return sorted(marks)


def plot_schedule(schedule: RecipeSchedule, path: str | os.PathLike, *, measured: dict | None = None) -> Path:
    """Write a PNG of every pruning target and the LR per step (atomically).

    ``measured`` may hold per-epoch points to overlay: ``{"epoch": [...], "sparsity": [...],
    "accuracy": [...]}``.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = sample_steps(schedule)
    epochs = [schedule.epoch_of(k) for k in steps]
    fig, (ax_s, ax_lr) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    curves = [(n, p) for n, p in enumerate(schedule.pruning, 1) if not p.constant]
    for n, p in curves[:MAX_PLOT_CURVES]:
        values = [p.sparsity(k) for k in steps]
        ax_s.step(epochs, [float("nan") if v is None else v for v in values], where="post",
                  label=f"P{n} target ({_spec(p.modifier.params)})")
    if len(curves) > MAX_PLOT_CURVES:
        ax_s.plot([], [], " ", label=f"(P{curves[MAX_PLOT_CURVES][0]}-P{curves[-1][0]} not drawn: see `recal check`)")
    if measured and measured.get("sparsity"):
        ax_s.plot(measured["epoch"], measured["sparsity"], "o", label="measured sparsity")
    if measured and measured.get("accuracy"):
        ax_acc = ax_s.twinx()
        ax_acc.plot(measured["epoch"], measured["accuracy"], "s--", color="tab:green", label="test accuracy")
        ax_acc.set_ylabel("accuracy")
        ax_acc.legend(loc="lower right")
    for index, m in schedule.quantization:
        start = schedule.epoch_of(schedule.span(m).start)
        ax_s.axvspan(start, schedule.epoch_of(schedule.total_steps), color="tab:purple", alpha=0.08,
                     label="QAT" if index == schedule.quantization[0][0] else None)
    ax_s.set_ylabel("sparsity")
    ax_s.set_ylim(0, 1)
    ax_s.grid(alpha=0.3)
    if ax_s.get_legend_handles_labels()[0]:
        ax_s.legend(loc="upper left")
    relative = schedule.needs_base_lr()
    lrs = [schedule.lr(k, base_lr=1.0 if relative else None) for k in steps]
    if any(v is not None for v in lrs):
        ax_lr.step(epochs, [float("nan") if v is None else v for v in lrs], where="post", color="tab:red")
    ax_lr.set_ylabel("lr (x optimizer lr)" if relative else "learning rate")
    ax_lr.set_xlabel("epoch")
    ax_lr.grid(alpha=0.3)
    fig.suptitle(f"{Path(schedule.recipe.source).name} (steps_per_epoch={schedule.steps_per_epoch})")
    fig.tight_layout()
    return save_figure_atomically(fig, path)


def save_figure_atomically(fig, path: str | os.PathLike) -> Path:
    import matplotlib.pyplot as plt

    try:
        with atomic_path(path) as tmp:
            fig.savefig(tmp, dpi=110, format="png")
    finally:
        plt.close(fig)
    return Path(path)
