"""What every export script here shares: a small ResNet (torchvision's BasicBlock, widths 16 to 128, 32x32 inputs,
10 classes; random weights, a few hundred kB) and synthetic calibration batches; a small BERT and real text for the
transformer exports; the torchvision names aimet-torch imports. Imports torch alone (``transformers`` where a BERT is
built), so it runs in each tool's own virtual environment beside its pinned torch."""

from __future__ import annotations

import importlib.machinery
import sys
import types
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
from bench.models import BasicBlock  # noqa: E402

FIXTURES = ROOT / "tests" / "fixtures" / "interop"
SIZE, CLASSES = 32, 10


class SmallResNet(nn.Module):
    """ResNet-18's stem and four stages of BasicBlocks at 1/4 width, one block a stage."""

    def __init__(self, classes: int = CLASSES):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, 1, 1, bias=False), nn.BatchNorm2d(16), nn.ReLU())
        layers, cin = [], 16
        for cout, stride in ((16, 1), (32, 2), (64, 2), (128, 2)):
            layers.append(BasicBlock(cin, cout, stride))
            cin = cout
        self.layers = nn.Sequential(*layers)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(cin, classes)

    def forward(self, x):
        return self.fc(torch.flatten(self.pool(self.layers(self.stem(x))), 1))


def calibration(batches: int = 8, batch: int = 8, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(batch, 3, SIZE, SIZE, generator=g) for _ in range(batches)]


def trained(model: nn.Module, steps: int = 20, seed: int = 0) -> nn.Module:
    """A few SGD steps on class templates plus noise, so the batch norms and ranges are a trained net's."""
    g = torch.Generator().manual_seed(seed)
    templates = torch.randn(CLASSES, 3, SIZE, SIZE, generator=g)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    model.train()
    for _ in range(steps):
        y = torch.randint(0, CLASSES, (32,), generator=g)
        x = templates[y] + 0.5 * torch.randn(32, 3, SIZE, SIZE, generator=g)
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
    return model.eval()


def export_torchscript(model: nn.Module, name: str, opset: int, folder: Path = FIXTURES) -> None:
    """``model`` by torch.onnx's TorchScript path (the one these tools document), batch fixed at 1, into
    ``folder / name``."""
    import warnings

    folder.mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(model, torch.randn(1, 3, SIZE, SIZE), folder / name, dynamo=False, input_names=["input"],
                          opset_version=opset)
    print("wrote", folder / name)


# A small BERT for the transformer exports: byte tokens of the Python standard library's own source (real text),
# classified by the module they come from; Hugging Face ``transformers`` builds it from a config (random weights).
TOKENS, TEXT_CLASSES = 32, 4
TEXT_SOURCES = ("argparse.py", "LICENSE.txt", "encodings/cp1252.py", "pydoc_data/topics.py")


class Logits(nn.Module):
    """A classifier's logits from token ids alone (a module of its own: AIMET's ``sim.export`` pickles the model)."""

    def __init__(self, classifier: nn.Module):
        super().__init__()
        self.bert = classifier

    def forward(self, input_ids):
        return self.bert(input_ids=input_ids).logits


def small_bert() -> nn.Module:
    """BertForSequenceClassification: 2 layers, hidden 128, 4 heads, a 256-byte vocabulary, eager attention (the
    matmuls and softmax every exporter writes alike); its forward takes token ids alone and returns the logits."""
    import transformers

    config = transformers.BertConfig(vocab_size=256, hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=512, max_position_embeddings=TOKENS, num_labels=TEXT_CLASSES,
                                     attn_implementation="eager")
    return Logits(transformers.BertForSequenceClassification(config))


def text_batches(batches: int, batch: int = 16, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(token ids, module index) batches: ``TOKENS``-byte windows of :data:`TEXT_SOURCES` at random offsets."""
    import sysconfig

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts = [torch.tensor(list((stdlib / name).read_bytes()), dtype=torch.long) for name in TEXT_SOURCES]
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(batches):
        labels = torch.randint(0, len(texts), (batch,), generator=g)
        starts = [int(torch.randint(0, len(texts[c]) - TOKENS, (1,), generator=g)) for c in labels]
        out.append((torch.stack([texts[c][s:s + TOKENS] for c, s in zip(labels, starts)]), labels))
    return out


def trained_on_text(model: nn.Module, steps: int = 200, seed: int = 0, lr: float = 1e-3) -> nn.Module:
    """A few Adam steps of the module-classification task, so ranges and the classifier are a trained net's."""
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    model.train()
    for ids, labels in text_batches(steps, seed=seed):
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(ids), labels).backward()
        optimizer.step()
    return model.eval()


def text_accuracy(model: nn.Module, batches: int = 16) -> float:
    """The share of held-out windows (another seed) classified right."""
    with torch.no_grad():
        pairs = [(model(ids).argmax(-1) == labels).float().mean() for ids, labels in text_batches(batches, seed=99)]
    return float(torch.stack(pairs).mean())


def export_text_model(model: nn.Module, name: str, opset: int, folder: Path = FIXTURES) -> None:
    """``model`` by torch.onnx's TorchScript path, token ids of batch 1 and ``TOKENS`` positions fixed, into
    ``folder / name``."""
    import warnings

    folder.mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(model, torch.zeros(1, TOKENS, dtype=torch.long), folder / name, dynamo=False,
                          input_names=["input_ids"], output_names=["logits"], opset_version=opset)
    print("wrote", folder / name)


def trained_bert() -> nn.Module:
    """The small BERT (seed 0) after :func:`trained_on_text`, its float accuracy printed: what every BERT export
    starts from."""
    torch.manual_seed(0)
    model = trained_on_text(small_bert())
    print("float accuracy", text_accuracy(model))
    return model


def fp32_for_onnx_quantizers(folder: Path) -> dict[str, tuple[Path, list[dict]]]:
    """The trained small BERT and ResNet exported to fp32 ONNX in ``folder`` (batch 1), each with its calibration
    feeds, a sample each (64 text windows, 64 images): what the tools that quantize ONNX files start from."""
    bert = trained_bert()
    resnet = trained(SmallResNet())
    export_text_model(bert, "bert.onnx", opset=17, folder=folder)
    export_torchscript(resnet, "resnet.onnx", opset=17, folder=folder)
    text = [{"input_ids": window[None].numpy()} for ids, _ in text_batches(4, seed=1) for window in ids]
    images = [{"input": x[i:i + 1].numpy()} for x in calibration() for i in range(len(x))]
    return {"bert": (folder / "bert.onnx", text), "resnet": (folder / "resnet.onnx", images)}


def stand_in_torchvision() -> None:
    """The names aimet-torch reads from torchvision at import (its detection ops and data helpers), none used here."""
    vision = types.ModuleType("torchvision")
    vision.__spec__ = importlib.machinery.ModuleSpec("torchvision", None)  # transformers asks find_spec of it
    for part in ("ops", "transforms", "datasets"):
        setattr(vision, part, types.ModuleType(f"torchvision.{part}"))
        getattr(vision, part).__spec__ = importlib.machinery.ModuleSpec(f"torchvision.{part}", None)
        sys.modules[f"torchvision.{part}"] = getattr(vision, part)
    vision.ops.RoIPool = type("RoIPool", (torch.nn.Module,), {})
    vision.ops.roi_align = vision.ops.nms = None
    vision.transforms.Resize = type("Resize", (torch.nn.Module,), {})
    sys.modules["torchvision"] = vision


def export_aimet_classic(sim, example: torch.Tensor, path: Path, inputs: list[torch.Tensor]) -> None:
    """AIMET's classic ``sim.export``: the float model to ``path`` and its encodings beside it (``.encodings``), then
    :func:`check_aimet_reading` on ``inputs``."""
    import shutil
    import tempfile
    import warnings

    with tempfile.TemporaryDirectory() as folder, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sim.export(folder, "model", example)
        shutil.copy(Path(folder) / "model.onnx", path)
        shutil.copy(Path(folder) / "model.encodings", path.with_suffix(".encodings"))
    print("wrote", path, "and", path.with_suffix(".encodings"))
    check_aimet_reading(sim, path, inputs)


def check_aimet_reading(sim, path: Path, inputs: list[torch.Tensor]) -> None:
    """recal's reading of AIMET's float model at ``path`` and its ``.encodings`` (``recal_onnx.read_as_qdq``),
    run in onnxruntime as written (optimizations off), against AIMET's simulation ``sim`` itself on ``inputs``, in
    steps of the output's quantizer; printed. Needs onnxruntime, onnx_ir and pydantic beside the tool."""
    import numpy as np
    import onnxruntime as ort

    sys.path.insert(0, str(ROOT))
    from recal_onnx import read_as_qdq

    encodings = path.with_suffix(".encodings")
    read = read_as_qdq(path, encodings)
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(read.SerializeToString(), options, providers=["CPUExecutionProvider"])
    step = next(float(e.scales[0]) for e in encodings if e.name == read.graph.output[0].name)
    worst, differ, total = 0.0, 0, 0
    with torch.no_grad():
        for x in inputs:
            theirs = sim.model(x).numpy()
            ours = session.run(None, {session.get_inputs()[0].name: x.numpy()})[0]
            worst = max(worst, float(np.abs(ours - theirs).max()) / step)
            differ, total = differ + int((np.abs(ours - theirs) > step / 2).sum()), total + ours.size
    print(f"recal's reading against AIMET's simulation, {total} outputs: {differ} a step apart, at most "
          f"{worst:.2f} steps")

