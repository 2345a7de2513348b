"""recal's PyTorch side on a GPU in bf16, in one go: what a session lent a device runs (the device tool's README).

Two models under a recipe, each trained in ``torch.autocast`` (bf16) on ``--device``:

- a ResNet-18 (``scripts/bench/models.py``, 10 classes, 64x64 synthetic images) with magnitude pruning and QAT starting
  mid-run;
- a Llama-shaped decoder (Hugging Face ``transformers`` from a small config, random weights) with magnitude pruning
  of its MLPs and int4 weight-only QAT (groups of 32).

For each: every tensor recal keeps (masks, observers, scales) lies on the parameters' device; the step time against
the same model trained plainly (no manager), medians over the pruning steps and over the QAT steps apart; a run
stopped mid-way, saved, loaded into a fresh model, optimizer and manager and finished ends on the same weights as the
uninterrupted one; the trained model, moved to the CPU, exports to ONNX and converts to its integer form, verified.
Runs on a CPU too (``--device cpu``: the suite's check that the script itself works).

    python scripts/gpu_check.py [--device cuda] [--steps 24] [--json OUT/gpu_check.json]
"""

from __future__ import annotations

import argparse
import copy
import io
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
                          weights: {{num_bits: 4, strategy: group, group_size: 32}}}}, ignore: [lm_head]}}
"""
STEPS_PER_EPOCH = 4


def resnet(device: str):
    model = ResNet18(10).to(device)

    def batch(step: int):
        g = torch.Generator().manual_seed(step)
        return torch.randn(16, 3, 64, 64, generator=g).to(device), torch.randint(0, 10, (16,), generator=g).to(device)

    return model, batch, RESNET_RECIPE


def decoder(device: str):
    import transformers

    config = transformers.LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
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
        ids = torch.randint(0, 512, (8, 32), generator=g).to(device)
        return ids, ids

    return Logits(), batch, DECODER_RECIPE


def loss_of(model, x, y):
    out = model(x)
    return F.cross_entropy(out.reshape(-1, out.shape[-1]).float(), y.reshape(-1))


def train(build, device: str, steps: int, recipe: str | None, stop: int | None = None, state=None):
    """``steps`` bf16 steps of ``build``'s model (under ``recipe`` when given); from ``state`` (a saved run) when
    given; returns the model, its manager, per-step seconds and, at ``stop``, the saved state."""
    torch.manual_seed(0)
    model, batch, _ = build(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    manager = None
    if recipe is not None:
        manager = ScheduledModifierManager.from_yaml(recipe.format(half=steps // (2 * STEPS_PER_EPOCH)))
        optimizer = manager.modify(model, optimizer, steps_per_epoch=STEPS_PER_EPOCH)
    start, saved, seconds = 0, None, []
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
        t0 = time.perf_counter()
        with torch.autocast(device_type=device.split(":")[0], dtype=torch.bfloat16):
            loss = loss_of(model, x, y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        _sync(device)
        seconds.append(time.perf_counter() - t0)
        if not torch.isfinite(loss.detach()):
            raise RuntimeError(f"step {step}: the loss is not finite")
    return model, manager, seconds, saved


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


def check(name: str, build, device: str, steps: int, folder: Path) -> dict:
    recipe = build(device)[2]
    model, manager, recal_s, _ = train(build, device, steps, recipe)
    _, _, plain_s, _ = train(build, device, steps, None)
    stray = off_device(model, manager, device)
    _, _, _, saved = train(build, device, steps, recipe, stop=steps // 2 + 1)
    resumed, _, _, _ = train(build, device, steps, recipe, state=saved)
    same = all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), resumed.state_dict().values()))
    half = steps // 2  # pruning before, QAT from here (the recipes' half)
    phases = {"pruning": slice(2, half), "qat": slice(half + 1, steps)}  # warm-up and the plan's step left out
    ms = {phase: (1e3 * statistics.median(recal_s[part]), 1e3 * statistics.median(plain_s[part]))
          for phase, part in phases.items()}
    cpu_model = copy.deepcopy(model).cpu().eval()
    x = build("cpu")[1](0)[0][:2]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        path = export_onnx(cpu_model, x, folder / f"{name}.qat.onnx")  # torch's default exporter
        result = quantize_qat_export(str(path), folder / f"{name}.int.onnx", inputs={"input": x.numpy()})
    row = {"model": name, "steps": steps, "ms": ms, "off_device": stray, "resume_exact": same,
           "verified": result.verification.problem(None) is None, "verification": str(result.verification),
           "quantized_layers": len(manager.quantized_layers)}
    times = ", ".join(f"{phase} {r:.2f} vs plain {p:.2f} ms/step ({100 * (r / p - 1):+.0f}%)"
                      for phase, (r, p) in ms.items())
    print(f"{name:8s} {times}; recal tensors off {device}: {len(stray)}; resume exact: {same}; "
          f"integer model verified: {row['verified']}", flush=True)
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--steps", type=int, default=24, help="steps per run (a multiple of 8)")
    parser.add_argument("--models", nargs="+", default=["resnet", "decoder"], choices=["resnet", "decoder"])
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args(argv)
    torch.use_deterministic_algorithms(True, warn_only=True)  # a resumed run must end on the same bits
    if args.device.startswith("cuda"):
        torch.backends.cudnn.benchmark = False
    name = torch.cuda.get_device_name(args.device) if args.device.startswith("cuda") else "CPU"
    print(f"device: {args.device} ({name}), torch {torch.__version__}, bf16 autocast, {args.steps} steps a run")
    builders = {"resnet": resnet, "decoder": decoder}
    with tempfile.TemporaryDirectory() as tmp:
        rows = [check(m, builders[m], args.device, args.steps, Path(tmp)) for m in args.models]
    failed = [r["model"] for r in rows if r["off_device"] or not r["resume_exact"] or not r["verified"]]
    if args.json:
        save(args.json, {"device": args.device, "name": name, **machine(), "rows": rows})
    print("PASS" if not failed else f"FAIL: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
