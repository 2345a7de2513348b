"""recal's PyTorch side on a GPU in mixed precision, in one go: what a session lent a device runs (the device tool's
README).

Two models under a recipe, each trained in ``torch.autocast`` on ``--device``:

- a ResNet-18 (``scripts/bench/models.py``, 10 classes, synthetic images) with magnitude pruning and QAT starting
  mid-run;
- a Llama-shaped decoder (Hugging Face ``transformers`` from a config, random weights) with magnitude pruning of its
  MLPs and int4 weight-only QAT (groups of 32).

For each, at a small size (the correctness checks): every tensor recal keeps (masks, observers, scales) lies on the
parameters' device; on CUDA, no step between mask updates synchronizes with the host from recal's code (CUDA's sync
debug mode, which flags every implicit device-to-host wait); a run stopped mid-way, saved, loaded into a fresh model,
optimizer and manager and finished ends on the same weights as the uninterrupted one; the same recipe trains in fp16
autocast with a ``GradScaler`` to a finite loss; the trained model, moved to the CPU, exports to ONNX and converts to
its integer form, verified. At the timing size (``--timing-size``; ``large`` on CUDA: a ResNet-18 on 224x224 images,
batch 64, and a 155 M-parameter decoder on 8 x 512 tokens) the step time against the same model trained plainly (no
manager), medians over the pruning steps between mask updates and over the QAT steps; with ``--compile``, the same
under ``torch.compile`` instead of the checks (its compile seconds apart). Runs on a CPU too (``--device cpu``: the
suite's check that the script itself works).

    python scripts/gpu_check.py [--device cuda] [--steps 24] [--compile] [--json OUT/gpu_check.json]
"""

from __future__ import annotations

import argparse
import copy
import io
import json
import os
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))
from recal_onnx import quantize_qat_export  # noqa: E402
from recal_torch import ScheduledModifierManager, export_onnx  # noqa: E402
from bench.models import ResNet18  # noqa: E402
from bench.results import machine, save  # noqa: E402

RESNET_RECIPE = """
- !GMPruningModifier {{params: __ALL_PRUNABLE__, init_sparsity: 0.3, final_sparsity: 0.7, start_epoch: 0,
                      end_epoch: {half}, update_frequency: 1}}
- !QuantizationModifier {{start_epoch: {half}}}
"""
DECODER_RECIPE = """
- !GMPruningModifier {{params: ['re:.*mlp\\.(gate|up|down)_proj\\.weight'], init_sparsity: 0.2, final_sparsity: 0.5,
                      start_epoch: 0, end_epoch: {half}, update_frequency: 1}}
- !QuantizationModifier {{start_epoch: {half}, scheme: {{input_activations: null,
                          weights: {{num_bits: 4, strategy: group, group_size: 32}}}}, ignore: [lm.lm_head]}}
"""
STEPS_PER_EPOCH = 4  # a mask update every 4 steps while pruning (update_frequency: 1 epoch)
SIZES = {  # per model and size: the model's size and a batch's
    "resnet": {"small": {"batch": 16, "image": 64}, "large": {"batch": 64, "image": 224}},
    "decoder": {"small": {"batch": 8, "tokens": 32, "vocab": 512, "hidden": 128, "ffn": 256, "layers": 2, "heads": 4,
                          "kv_heads": 2},
                "large": {"batch": 8, "tokens": 512, "vocab": 32000, "hidden": 1024, "ffn": 2816, "layers": 8,
                          "heads": 16, "kv_heads": 4}},
}


def resnet(device: str, size: str = "small"):
    shape = SIZES["resnet"][size]
    model = ResNet18(10).to(device)

    def batch(step: int):
        g = torch.Generator().manual_seed(step)
        x = torch.randn(shape["batch"], 3, shape["image"], shape["image"], generator=g)
        return x.to(device), torch.randint(0, 10, (shape["batch"],), generator=g).to(device)

    return model, batch, RESNET_RECIPE


def decoder(device: str, size: str = "small"):
    import transformers

    shape = SIZES["decoder"][size]
    config = transformers.LlamaConfig(
        vocab_size=shape["vocab"], hidden_size=shape["hidden"], intermediate_size=shape["ffn"],
        num_hidden_layers=shape["layers"], num_attention_heads=shape["heads"], num_key_value_heads=shape["kv_heads"],
        max_position_embeddings=shape["tokens"])
    torch.manual_seed(0)
    lm = transformers.LlamaForCausalLM(config).to(device)

    class Logits(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lm = lm

        def forward(self, ids):
            return self.lm(input_ids=ids, use_cache=False).logits

    def batch(step: int):
        g = torch.Generator().manual_seed(step)
        ids = torch.randint(0, shape["vocab"], (shape["batch"], shape["tokens"]), generator=g).to(device)
        return ids, ids

    return Logits(), batch, DECODER_RECIPE


def loss_of(model, x, y):
    out = model(x)
    return F.cross_entropy(out.reshape(-1, out.shape[-1]).float(), y.reshape(-1))


def train(*args, **kwargs):
    """:func:`training` to its end: the model, its manager, per-step seconds and the saved state."""
    return interleaved(training(*args, **kwargs))[0]


def interleaved(*runs) -> list:
    """Step ``runs`` (:func:`training`) in turn, one step each, so that a slow spell of the machine falls on all of
    them alike; their results."""
    results: list = [None] * len(runs)
    while any(r is None for r in results):
        for i, run in enumerate(runs):
            if results[i] is None:
                try:
                    next(run)
                except StopIteration as done:
                    results[i] = done.value
    return results


def training(build, device: str, steps: int, recipe: str | None, *, size: str = "small", stop: int | None = None,
             state=None, dtype=torch.bfloat16, compiled: bool = False, syncs: dict | None = None,
             profile: list | None = None):
    """``steps`` autocast steps of ``build``'s model (under ``recipe`` when given), yielding after each; from
    ``state`` (a saved run) when given; returns the model, its manager, per-step seconds and, at ``stop``, the saved
    state. ``syncs``, on CUDA,
    collects per step the lines of recal's code that made the host wait for the device; ``profile`` gets the
    table of the last three steps' most costly operations."""
    torch.manual_seed(0)
    model, batch, _ = build(device, size)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    manager = None
    if recipe is not None:
        manager = ScheduledModifierManager.from_yaml(recipe.format(half=steps // (2 * STEPS_PER_EPOCH)))
        optimizer = manager.modify(model, optimizer, steps_per_epoch=STEPS_PER_EPOCH)
    run = torch.compile(model) if compiled else model
    scaler = torch.amp.GradScaler(device.split(":")[0]) if dtype == torch.float16 else None
    start, saved, seconds, losses = 0, None, [], []
    if state is not None:
        optimizer.load_state_dict(state["optimizer"])  # first: recal re-creates its QAT layers
        model.load_state_dict(state["model"])
        start = state["step"]
    model.train()
    for step in range(start, steps):
        if stop is not None and step == stop:
            buffer = io.BytesIO()
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step}, buffer)
            buffer.seek(0)
            saved = torch.load(buffer, weights_only=True)
        x, y = batch(step)
        _sync(device)
        if profile is not None and step == steps - 3:
            profiler = torch.profiler.profile()
            profiler.__enter__()
        with _host_waits(device, syncs, step):
            t0 = time.perf_counter()
            with torch.autocast(device_type=device.split(":")[0], dtype=dtype):
                loss = loss_of(run, x, y)
            optimizer.zero_grad()
            if scaler is None:
                loss.backward()
                optimizer.step()
            else:
                scaler.scale(loss).backward()
                scaler.step(optimizer)
                scaler.update()
        _sync(device)
        seconds.append(time.perf_counter() - t0)
        losses.append(loss.detach())
        yield
    if profile is not None:
        profiler.__exit__(None, None, None)
        key = "self_device_time_total" if device.startswith("cuda") else "self_cpu_time_total"
        profile.append(profiler.key_averages().table(sort_by=key, row_limit=18, max_name_column_width=60))
    if not all(torch.isfinite(torch.stack(losses))):
        raise RuntimeError(f"{build.__name__}: a loss is not finite ({dtype})")
    return model, manager, seconds, saved


class _host_waits:
    """On CUDA with ``syncs``: record, under ``syncs[step]``, the lines of Python that made the host wait for the
    device (CUDA's sync debug mode warns at each implicit wait, naming the calling line)."""

    def __init__(self, device: str, syncs: dict | None, step: int):
        self.on = syncs is not None and device.startswith("cuda")
        self.syncs, self.step = syncs, step

    def __enter__(self):
        if self.on:
            self.caught = warnings.catch_warnings(record=True)
            self.seen = self.caught.__enter__()
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")

    def __exit__(self, *exc):
        if self.on:
            torch.cuda.set_sync_debug_mode("default")
            self.caught.__exit__(*exc)
            lines = {f"{w.filename}:{w.lineno}" for w in self.seen if "synchroniz" in str(w.message)}
            if lines:
                self.syncs[self.step] = sorted(lines)


def _recal_lines(syncs: dict[int, list[str]], steps: set[int]) -> dict[int, list[str]]:
    """Of ``syncs``, the lines in recal's own packages at ``steps``."""
    found = {k: [line for line in lines if str(ROOT / "recal_") in line] for k, lines in syncs.items() if k in steps}
    return {k: lines for k, lines in found.items() if lines}


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def off_device(model: torch.nn.Module, manager, device: str) -> list[str]:
    """recal's tensors (the model's buffers and parameters, the masks) that are not on ``device``."""
    want = torch.device(device).type
    found = [f"{name} ({t.device})" for name, t in [*model.named_parameters(), *model.named_buffers()]
             if t.device.type != want]
    found += [f"mask of {name} ({m.device})" for name, per in manager.masks.masks.items() for m in per.values()
              if m.device.type != want]
    return found


def _phases(steps: int) -> dict[str, list[int]]:
    """The steps timed: pruning steps between mask updates (an update every STEPS_PER_EPOCH steps) and QAT steps
    after its first (the plan); the first two steps (warm-up) left out."""
    half = steps // 2  # a step k whose optimizer step ends an epoch updates the masks of step k + 1
    return {"pruning": [k for k in range(2, half) if (k + 1) % STEPS_PER_EPOCH],
            "qat": list(range(half + 1, steps))}


def _times(recal_s: list[float], plain_s: list[float], steps: int) -> dict[str, tuple[float, float]]:
    return {phase: (1e3 * statistics.median(recal_s[k] for k in ks), 1e3 * statistics.median(plain_s[k] for k in ks))
            for phase, ks in _phases(steps).items()}


def _describe(ms: dict[str, tuple[float, float]]) -> str:
    return ", ".join(f"{phase} {r:.2f} vs plain {p:.2f} ms/step ({100 * (r / p - 1):+.1f}%)"
                     for phase, (r, p) in ms.items())


def check(name: str, build, device: str, steps: int, folder: Path, timing_size: str, compiled: bool,
          profiled: bool = False) -> dict:
    if compiled:
        return {"model": name, "steps": steps, "timing_size": timing_size, "shape": SIZES[name][timing_size],
                "compiled": compiled_times(name, build, device, steps, timing_size)}
    recipe = build(device)[2]
    syncs: dict[int, list[str]] = {}
    model, manager, _, _ = train(build, device, steps, recipe, syncs=syncs)
    stray = off_device(model, manager, device)
    _, _, _, saved = train(build, device, steps, recipe, stop=steps // 2 + 1)
    resumed, _, _, _ = train(build, device, steps, recipe, state=saved)
    same = all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), resumed.state_dict().values()))
    fp16 = device.startswith("cuda")  # (fp16 autocast on a CPU is no user's choice, and slow)
    if fp16:
        train(build, device, steps, recipe, dtype=torch.float16)  # raises if a loss is not finite
    between = set(_phases(steps)["pruning"]) | set(_phases(steps)["qat"])
    waits = _recal_lines(syncs, between)
    plain_syncs: dict[int, list[str]] = {}
    train(build, device, steps, None, syncs=plain_syncs)
    host_waits = {"recal": sum(len(syncs.get(k, ())) for k in between),
                  "plain": sum(len(plain_syncs.get(k, ())) for k in between), "steps": len(between)}
    (_, _, recal_s, _), (_, _, plain_s, _) = interleaved(training(build, device, steps, recipe, size=timing_size),
                                                         training(build, device, steps, None, size=timing_size))
    ms = _times(recal_s, plain_s, steps)
    if profiled:  # apart: one profiler at a time
        tables: list[str] = []
        for recipe_or_none in (recipe, None):
            train(build, device, steps, recipe_or_none, size=timing_size, profile=tables)
        for label, table in zip(("recal (QAT steps)", "plain"), tables):
            print(f"{name} {label}, last three steps:\n{table}", flush=True)
    cpu_model = copy.deepcopy(model).cpu().eval()
    x = build("cpu")[1](0)[0][:2]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        path = export_onnx(cpu_model, x, folder / f"{name}.qat.onnx")  # torch's default exporter
        result = quantize_qat_export(str(path), folder / f"{name}.int.onnx", inputs={"input": x.numpy()})
    row = {"model": name, "steps": steps, "timing_size": timing_size, "shape": SIZES[name][timing_size], "ms": ms,
           "off_device": stray, "host_waits_in_recal": waits, "host_waits": host_waits, "resume_exact": same,
           "fp16_finite": fp16 or None, "verified": result.verification.problem(None) is None,
           "verification": str(result.verification), "quantized_layers": len(manager.quantized_layers)}
    print(f"{name:8s} ({timing_size}) {_describe(ms)}; recal tensors off {device}: {len(stray)}; host waits in "
          f"{host_waits['steps']} steps between updates: {host_waits['recal']} (plain {host_waits['plain']}), "
          f"{len(waits)} steps with one in recal's code; resume exact: {same}; "
          f"{'fp16 + GradScaler finite; ' if fp16 else ''}integer model verified: {row['verified']}", flush=True)
    return row


def compiled_times(name: str, build, device: str, steps: int, size: str) -> dict:
    """Step times under ``torch.compile`` (inductor): recal's recipe against plain training; the first step of
    each phase (compiling) apart."""
    t0 = time.perf_counter()
    (_, _, recal_s, _), (_, _, plain_s, _) = interleaved(
        training(build, device, steps, build(device)[2], size=size, compiled=True),
        training(build, device, steps, None, size=size, compiled=True))
    ms = _times(recal_s, plain_s, steps)
    out = {"ms": ms, "first_step_s": [recal_s[0], plain_s[0]], "qat_first_step_s": recal_s[steps // 2],
           "wall_s": time.perf_counter() - t0}
    print(f"{name:8s} ({size}, torch.compile) {_describe(ms)}; first step {recal_s[0]:.1f} s (plain "
          f"{plain_s[0]:.1f} s), QAT's first {recal_s[steps // 2]:.1f} s", flush=True)
    return out


def table(data: dict) -> str:
    """The docs' table of a saved run (``docs/results/gpu_check.json``)."""
    def cell(ms: dict | None, phase: str) -> str:
        if not ms:
            return "-"
        r, p = ms[phase]
        return f"{r:.1f} vs {p:.1f} ({100 * (r / p - 1):+.0f}%)"

    lines = ["| model (timed at) | pruning, eager | QAT, eager | pruning, torch.compile | QAT, torch.compile | "
             "host waits from recal | resume | fp16 | integer model |", "|---|---|---|---|---|---:|---|---|---|"]
    for row in data["rows"]:
        shape = row["shape"]
        at = (f"batch {shape['batch']}, {shape['image']}x{shape['image']}" if "image" in shape else
              f"{shape['layers']} layers x {shape['hidden']}, {shape['batch']} x {shape['tokens']} tokens")
        compiled = row.get("compiled", {}).get("ms")
        lines.append(f"| {row['model']} ({at}) | {cell(row['ms'], 'pruning')} | {cell(row['ms'], 'qat')} | "
                     f"{cell(compiled, 'pruning')} | {cell(compiled, 'qat')} | {len(row['host_waits_in_recal'])} | "
                     f"{'exact' if row['resume_exact'] else 'DIFFERS'} | {'finite' if row['fp16_finite'] else '-'} | "
                     f"{'verified' if row['verified'] else 'FAILED'} |")
    return ("\n".join(lines) + f"\n\n{data['name']}, torch {data['torch']}, bf16 autocast; ms per step, recal's recipe "
            "against the same model trained plainly, medians over the pruning steps between mask updates and over the "
            "QAT steps after the first; host waits: steps between updates in which recal's code made the host wait "
            "for the GPU (CUDA's sync debug mode). `python scripts/gpu_check.py --device cuda [--compile]`, one model "
            "a process, joined with `--merge`.")


def merge(runs: list[dict]) -> dict:
    """Runs of one device (each model, checked or compiled, in a process of its own) as one: per model, its
    checks' row with the compiled timing beside it."""
    if len({(r["name"], r["cpu"], r["torch"]) for r in runs}) != 1:
        raise SystemExit("the runs to merge come from different machines or versions")
    rows: dict[str, dict] = {}
    for run in runs:
        for row in run["rows"]:
            rows.setdefault(row["model"], {}).update(row)
    return {**{k: v for k, v in runs[0].items() if k != "rows"}, "rows": list(rows.values())}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--steps", type=int, default=24, help="steps per run (a multiple of 8)")
    parser.add_argument("--models", nargs="+", default=["resnet", "decoder"], choices=["resnet", "decoder"])
    parser.add_argument("--timing-size", choices=["small", "large"], help="default: large on CUDA, else small")
    parser.add_argument("--compile", action="store_true", help="time both under torch.compile instead")
    parser.add_argument("--profile", action="store_true", help="print each timed run's costliest operations")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    parser.add_argument("--merge", nargs="+", type=Path, metavar="JSON",
                        help="instead of running: join these runs' rows (one machine's) into --json")
    args = parser.parse_args(argv)
    if args.merge:
        save(args.json, merge([json.loads(p.read_text()) for p in args.merge]))
        return 0
    timing_size = args.timing_size or ("large" if args.device.startswith("cuda") else "small")
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS, before CUDA starts
    torch.use_deterministic_algorithms(True, warn_only=True)  # a resumed run must end on the same bits
    if args.device.startswith("cuda"):
        torch.backends.cudnn.benchmark = False
    name = torch.cuda.get_device_name(args.device) if args.device.startswith("cuda") else "CPU"
    print(f"device: {args.device} ({name}), torch {torch.__version__}, bf16 autocast, {args.steps} steps a run")
    builders = {"resnet": resnet, "decoder": decoder}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for m in args.models:
            rows.append(check(m, builders[m], args.device, args.steps, Path(tmp), timing_size, args.compile,
                              args.profile))
            if args.json:  # after each model: a run cut short keeps what it measured
                save(args.json, {"device": args.device, "name": name, **machine(), "rows": rows})
    failed = [r["model"] for r in rows if "compiled" not in r and (
        r["off_device"] or r["host_waits_in_recal"] or not r["resume_exact"] or not r["verified"])]
    print("PASS" if not failed else f"FAIL: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
