"""Transformers on onnxruntime: fp32 vs recal's int8 (``qoperator``, ``qdq``) vs onnxruntime's own quantizers.

A BERT-base-shaped encoder (12 layers, hidden 768, 12 heads, vocabulary 30522) at sequence 128, a
ViT-B/16-shaped model at 224x224, Swin-tiny (224x224) and MobileViT-small (256x256) at their default configs, built
by Hugging Face ``transformers`` with random weights (nothing is downloaded). Each runs a few QAT steps under a recal
recipe on synthetic data, so the observers hold real
ranges, and is exported (QDQ) and converted by ``quantize_qat_export``; the float model is exported too and
quantized by onnxruntime's ``quantize_dynamic`` (int8 weights) and ``quantize_static`` (QDQ, uint8
activations, int8 per-channel weights, after ``quant_pre_process``, calibrated on 8 synthetic inputs).

One table per model: median latency at batch 1 with 1 and 2 threads (every model runs in turn, round after
round, so drift hits all alike), size and its ratio to fp32, conversion time and the converter's peak
resident memory above its imports (a fresh process, sampled every 2 ms) against the input model's size,
argmax agreement with the model's own reference on 16 inputs, 64 with ``--quick`` (recal: the QAT export run
as float QDQ; onnxruntime's: the fp32 model). Run it on an idle machine: it measures latency.

    python scripts/bench_transformers.py [--quick] [--rounds 15] [--models bert vit swin mobilevit] [--attention]
        [--json docs/results/transformers.json]

``--json`` keeps the runs of other CPUs in that file and replaces this CPU's.

``--attention`` adds rows for the same model with its attention matmuls quantized too
(``modify(..., quantize_attention=True)``).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np
import onnxruntime as ort
import torch
import torch.nn.functional as F
from torch import nn

from recal_onnx import reference_session, session
from recal_torch import ScheduledModifierManager, export_onnx

from bench.peers import DYNAMIC, STATIC, quantize_dynamic, quantize_static
from bench.results import machine, save_run
from bench.timing import interleaved_latency
from bench_onnx import convert_measured

ROOT = Path(__file__).resolve().parent.parent

QAT_ONLY = """
- !EpochRangeModifier {start_epoch: 0, end_epoch: 1}
- !QuantizationModifier {start_epoch: 0, reduce_range: true}  # 7-bit weights: int8 and exact on every CPU
"""


class Classifier(nn.Module):
    """A Hugging Face model that returns its logits (the exporters want tensors out)."""

    def __init__(self, model: nn.Module, keys: tuple[str, ...]):
        super().__init__()
        self.model, self.keys = model, keys

    def forward(self, *inputs):
        return self.model(**dict(zip(self.keys, inputs))).logits


def bert(quick: bool, seq: int):
    import transformers

    shape = dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=2, intermediate_size=512) if quick \
        else dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072)
    config = transformers.BertConfig(vocab_size=30522, max_position_embeddings=512, num_labels=2, **shape)
    model = Classifier(transformers.BertForSequenceClassification(config), ("input_ids", "attention_mask"))

    def batch(n: int, g: torch.Generator):
        ids = torch.randint(0, 30522, (n, seq), generator=g)
        return (ids, torch.ones_like(ids))

    return model, batch, ("input_ids", "attention_mask")


def vit(quick: bool, seq: int):
    import transformers

    shape = dict(image_size=64, patch_size=16, hidden_size=128, num_hidden_layers=2, num_attention_heads=2,
                 intermediate_size=512) if quick else \
        dict(image_size=224, patch_size=16, hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
             intermediate_size=3072)
    config = transformers.ViTConfig(num_labels=10, **shape)
    model = Classifier(transformers.ViTForImageClassification(config), ("pixel_values",))
    size = shape["image_size"]

    def batch(n: int, g: torch.Generator):
        return (torch.randn(n, 3, size, size, generator=g),)

    return model, batch, ("pixel_values",)


def _image_model(model_class, config, size: int):
    model = Classifier(model_class(config), ("pixel_values",))

    def batch(n: int, g: torch.Generator):
        return (torch.randn(n, 3, size, size, generator=g),)

    return model, batch, ("pixel_values",)


def swin(quick: bool, seq: int):
    """Swin-tiny at its default config (what ``SwinConfig()`` builds), 224x224."""
    import transformers

    shape = dict(image_size=32, patch_size=4, embed_dim=16, depths=[1, 1], num_heads=[2, 2], window_size=4) \
        if quick else {}
    config = transformers.SwinConfig(num_labels=10, **shape)
    return _image_model(transformers.SwinForImageClassification, config, config.image_size)


def mobilevit(quick: bool, seq: int):
    """MobileViT-small at its default config (``MobileViTConfig()``), 256x256: convolutions, SiLUs and
    transformer blocks; torch-initialised (``bench.models.torch_init``: transformers' draws make its activations vanish)."""
    import transformers

    from bench.models import torch_init

    config = transformers.MobileViTConfig(num_labels=10, **(dict(image_size=64) if quick else {}))
    model, batch, names = _image_model(transformers.MobileViTForImageClassification, config, config.image_size)
    return torch_init(model), batch, names


SESSIONS = 3  # each file timed in this many sessions of its own (bench.timing.interleaved_latency): in one session
# each, BERT-base's recal and quantize_static files differed by 4.7%; in three each, by under 1% (AMD EPYC)
MODELS = {"bert": bert, "vit": vit, "swin": swin, "mobilevit": mobilevit}


def feeds(batch, names, n: int, seed: int) -> dict[str, np.ndarray]:
    return {k: v.numpy() for k, v in zip(names, batch(n, torch.Generator().manual_seed(seed)))}


def qat(model: nn.Module, batch, steps: int, attention: bool = False) -> nn.Module:
    manager = ScheduledModifierManager.from_yaml(QAT_ONLY)
    optimizer = manager.modify(model, torch.optim.AdamW(model.parameters(), lr=1e-5), steps_per_epoch=steps,
                               quantize_attention=attention)
    model.train()
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        logits = model(*batch(2, g))
        optimizer.zero_grad()
        F.cross_entropy(logits, torch.zeros(len(logits), dtype=torch.long)).backward()
        optimizer.step()
    manager.finalize(model)
    return model.eval()


def ort_quantized(fp32: Path, folder: Path, calibration: list[dict[str, np.ndarray]]) -> dict[str, tuple[Path, float]]:
    """onnxruntime's dynamic and static quantization of ``fp32`` (:mod:`bench.peers`): path and seconds, by label."""
    out = {DYNAMIC: (folder / "dynamic.onnx", quantize_dynamic(fp32, folder / "dynamic.onnx"))}
    out[STATIC] = (folder / "static.onnx", quantize_static(fp32, folder / "static.onnx", calibration))
    return out


def agreement(path: Path, reference: Path, checks: list[dict[str, np.ndarray]]) -> float:
    got, ref = session(str(path), 2), reference_session(str(reference))
    return float(np.mean([np.argmax(got.run(None, f)[0]) == np.argmax(ref.run(None, f)[0]) for f in checks]))


def bench(name: str, build, quick: bool, seq: int, rounds: int, folder: Path, attention: bool = False) -> dict:
    """Build, QAT-train, export, convert and time one model; print its table and return its rows."""
    torch.manual_seed(0)
    model, batch, names = build(quick, seq)
    one = batch(1, torch.Generator().manual_seed(0))
    fp32, qat_path = folder / f"{name}.fp32.onnx", folder / f"{name}.qat.onnx"
    t0 = time.perf_counter()
    export_onnx(model.eval(), one, fp32, dynamo=False, input_names=names, dynamic_batch=False)
    qat(model, batch, steps=2 if quick else 3)
    export_onnx(model, one, qat_path, dynamo=False, input_names=names, dynamic_batch=False)
    print(f"  {name}: built, QAT-trained and exported in {time.perf_counter() - t0:.0f}s", flush=True)
    paths = {"fp32": (fp32, float("nan"), float("nan"))}
    exports = {"": qat_path}
    if attention:  # the same model, its attention matmuls quantized too
        torch.manual_seed(0)
        model = qat(build(quick, seq)[0], batch, steps=2 if quick else 3, attention=True)
        exports[" +attention"] = folder / f"{name}.qat-attention.onnx"
        export_onnx(model, one, exports[" +attention"], dynamo=False, input_names=names, dynamic_batch=False)
    for suffix, source in exports.items():
        for fmt in ("qoperator", "qdq"):
            target = folder / f"{name}.{fmt}{suffix.strip()}.onnx"
            seconds, peak = convert_measured(source, target, fmt)
            paths[f"recal {fmt}{suffix}"] = (target, seconds, peak)
    calibration = [feeds(batch, names, 1, seed) for seed in range(100, 108)]
    for label, (path, seconds) in ort_quantized(fp32, folder, calibration).items():
        paths[label] = (path, seconds, float("nan"))
    feed = feeds(batch, names, 1, 0)
    latency = {t: interleaved_latency({k: v[0] for k, v in paths.items()}, feed, rounds, per_round=1, threads=t,
                                      sessions=SESSIONS) for t in (1, 2)}
    checks = [feeds(batch, names, 1, seed) for seed in range(200, 200 + (64 if quick else 16))]
    fp32_size, qat_size = fp32.stat().st_size, qat_path.stat().st_size
    print(f"\n{name}: onnxruntime {ort.__version__}, batch 1, median of {rounds} interleaved rounds of {SESSIONS} "
          "sessions each; "
          f"QAT export {qat_size / 1e6:.1f} MB")
    print(f"{'model':26s} {'MB':>8s} {'x fp32':>7s} {'t1 ms':>8s} {'t2 ms':>8s} {'vs fp32 t1':>10s} "
          f"{'agree':>6s} {'convert s':>9s} {'peak x in':>9s}")
    rows = []
    for label, (path, seconds, peak) in paths.items():
        size = path.stat().st_size
        reference = fp32 if label == "fp32" or label.startswith("ort") else \
            exports[" +attention"] if label.endswith("+attention") else qat_path
        agree = agreement(path, reference, checks)
        print(f"{label:26s} {size / 1e6:8.2f} {size / fp32_size:7.3f} {latency[1][label]:8.2f} "
              f"{latency[2][label]:8.2f} {latency[1]['fp32'] / latency[1][label]:9.2f}x "
              f"{agree:6.3f} {seconds:9.2f} {peak / qat_size:9.2f}", flush=True)
        rows.append({"label": label, "bytes": size, "ms_1": latency[1][label], "ms_2": latency[2][label],
                     "agree": agree, "convert_s": None if seconds != seconds else seconds,
                     "peak_x_input": None if peak != peak else peak / qat_size})
    return {"model": name, "seq": seq, "checks": len(checks), "fp32_bytes": fp32_size, "rows": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2-layer, hidden-128 models (a smoke test)")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--attention", action="store_true", help="also rows with the attention matmuls quantized")
    parser.add_argument("--json", type=Path, help="also write the tables here (docs/results/transformers.json)")
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="recal-bench-transformers-"))
    warnings.filterwarnings("ignore")
    models = [bench(name, MODELS[name], args.quick, args.seq, args.rounds, folder, args.attention)
              for name in args.models]
    print(f"\nmodels in {folder}")
    if args.json:  # one run per CPU: a run measured on another CPU is kept beside this one
        save_run(args.json, {**machine(), "rounds": args.rounds, "sessions": SESSIONS, "quick": args.quick,
                             "models": models})


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
