"""onnxruntime latency and size: fp32 vs QAT export vs recal's int8 outputs vs onnxruntime's quantize_static.

Models: a ResNet-18-style CNN at 224x224 and a stack of BERT-base-sized Linear layers (hidden 768),
QAT-trained a few steps on synthetic data (so observers hold real ranges), exported with recal_torch.
Prints one table per model: median latency at 1 and 2 threads, batch 1 and 16; model size;
conversion time and the converter's peak memory (resident, above its imports, in a fresh process);
argmax agreement of each ONNX model with its PyTorch model (the QAT model; fp32 and quantize_static:
the float model). Data are synthetic but learnable (class templates plus noise), so logits separate.
Last, a ResNet-50-sized QAT export is converted alone: time and peak memory against its size.

    python scripts/bench_onnx.py [--quick] [--repeat 20]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import subprocess
import sys
from pathlib import Path

import onnxruntime as ort
import torch
from torch import nn

from recal_torch import ScheduledModifierManager, export_onnx

from bench.models import QAT_RECIPE, LinearStack, ResNet18, ResNet50, templates, train_steps
from bench.peers import quantize_static
from bench.results import machine
from bench.timing import interleaved_latency


def qat_train(model: nn.Module, make_batch, steps: int) -> nn.Module:
    manager = ScheduledModifierManager.from_yaml(QAT_RECIPE)
    optimizer = manager.modify(model, torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9), steps_per_epoch=steps)
    model.train()
    for _ in range(steps):
        x, y = make_batch()
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
    manager.finalize(model)
    return model.eval()


def agreement(path: Path, model: nn.Module, inputs: torch.Tensor) -> float:
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    got = session.run(None, {session.get_inputs()[0].name: inputs.numpy()})[0]
    with torch.no_grad():
        ref = model(inputs).numpy()
    return float((got.argmax(-1) == ref.argmax(-1)).mean())


_CONVERT = """
import sys, threading, time, warnings
import numpy, onnx, onnxruntime
from recal_onnx import quantize_qat_export

def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096

base, peak, done = rss(), [0], threading.Event()

def sample():
    while not done.is_set():
        peak[0] = max(peak[0], rss())
        time.sleep(0.002)

thread = threading.Thread(target=sample)
thread.start()
t0 = time.perf_counter()
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    quantize_qat_export(sys.argv[1], sys.argv[2], format=sys.argv[3], verify=False)
seconds = time.perf_counter() - t0
done.set()
thread.join()
print(seconds, max(peak[0], rss()) - base)
"""


def convert_measured(src: Path, dst: Path, fmt: str) -> tuple[float, float]:
    """Convert in a fresh process; return seconds and the peak resident memory above its imports (bytes,
    sampled every 2 ms)."""
    out = subprocess.run([sys.executable, "-c", _CONVERT, str(src), str(dst), fmt], capture_output=True, text=True,
                         check=True)
    seconds, peak = out.stdout.split()[-2:]
    return float(seconds), float(peak)


def bench(name: str, float_model: nn.Module, qat_model: nn.Module, sample: torch.Tensor, check_inputs: torch.Tensor,
          batches: tuple[int, ...], repeat: int, folder: Path) -> None:
    paths = {"fp32": folder / f"{name}.fp32.onnx", "QAT export (QDQ)": folder / f"{name}.qat.onnx",
             "recal qoperator": folder / f"{name}.int8.onnx", "recal qdq": folder / f"{name}.qdq.onnx",
             "ort quantize_static": folder / f"{name}.static.onnx"}
    export_onnx(float_model.eval(), sample, paths["fp32"], dynamo=False)
    export_onnx(qat_model, sample, paths["QAT export (QDQ)"], dynamo=False)
    conversion = {"recal qoperator": convert_measured(paths["QAT export (QDQ)"], paths["recal qoperator"], "qoperator"),
                  "recal qdq": convert_measured(paths["QAT export (QDQ)"], paths["recal qdq"], "qdq")}

    feeds = [{"input": check_inputs[i: i + 8].numpy()} for i in range(0, 64, 8)]
    conversion["ort quantize_static"] = (quantize_static(paths["fp32"], paths["ort quantize_static"], feeds), float("nan"))

    fp32_size = paths["fp32"].stat().st_size
    columns = [(t, b) for t in (1, 2) for b in batches]
    header = f"{'model':22s} {'MB':>7s} {'x fp32':>7s} " + " ".join(f"{f't{t} b{b} ms':>11s}" for t, b in columns) \
        + f" {'speedup t1b1':>12s} {'agree':>6s} {'convert s':>9s} {'peak MB':>8s}"
    print(f"\n{name}: {machine()['cpu']}, onnxruntime {ort.__version__}, median of {repeat} interleaved rounds")
    print(header)
    ms = {(t, b): interleaved_latency(paths, {"input": torch.cat([sample] * b).numpy()}, rounds=repeat, per_round=1,
                                      threads=t) for t, b in columns}
    for label, path in paths.items():
        reference = float_model if label in ("fp32", "ort quantize_static") else qat_model
        times = [ms[c][label] for c in columns]
        size = path.stat().st_size
        sec, peak = conversion.get(label, (float("nan"), float("nan")))
        print(f"{label:22s} {size / 1e6:7.2f} {size / fp32_size:7.3f} " + " ".join(f"{v:11.2f}" for v in times)
              + f" {ms[columns[0]]['fp32'] / times[0]:11.2f}x {agreement(path, reference, check_inputs):6.3f}"
              + f" {sec:9.2f} {peak / 1e6:8.1f}")


def train_float(model: nn.Module, sample, steps: int, batch: int) -> nn.Module:
    return train_steps(model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9), sample, steps, batch)


def conversion_only(folder: Path, size: int) -> None:
    model = ResNet50(classes=10)
    sample = templates((3, size, size), 10)
    qat_train(model, lambda: sample(2), steps=2)
    path = folder / "resnet50.qat.onnx"
    export_onnx(model, sample(1)[0], path, dynamo=False)
    seconds, peak = convert_measured(path, folder / "resnet50.int8.onnx", "qoperator")
    mb = path.stat().st_size / 1e6
    print(f"\nresnet50-sized QAT export ({mb:.1f} MB): converted in {seconds:.2f}s, peak memory "
          f"{peak / 1e6:.1f} MB = {peak / 1e6 / mb:.2f}x the model")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="112x112 and one batch size (a smoke test)")
    parser.add_argument("--repeat", type=int, default=20)
    args = parser.parse_args()
    torch.manual_seed(0)
    size = 112 if args.quick else 224
    folder = Path(tempfile.mkdtemp(prefix="recal-bench-"))
    sample = templates((3, size, size), 10)
    cnn_float = train_float(ResNet18(classes=10), sample, steps=6, batch=8)
    cnn_qat = ResNet18(classes=10)
    cnn_qat.load_state_dict(cnn_float.state_dict())
    qat_train(cnn_qat, lambda: sample(8), steps=4 if args.quick else 8)
    check = sample(64)[0]
    bench("resnet18", cnn_float, cnn_qat, check[:1], check, (1,) if args.quick else (1, 16), args.repeat, folder)
    sample = templates((768,), 2)
    mlp_float = train_float(LinearStack(), sample, steps=20, batch=64)
    mlp_qat = LinearStack()
    mlp_qat.load_state_dict(mlp_float.state_dict())
    qat_train(mlp_qat, lambda: sample(64), steps=8)
    check = sample(64)[0]
    bench("linear768", mlp_float, mlp_qat, check[:1], check, (1, 16), args.repeat, folder)
    conversion_only(folder, size)
    print(f"\nmodels in {folder}")


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
