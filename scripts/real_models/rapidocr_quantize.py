"""Real pretrained weights, quantized as a user would: RapidOCR's text-direction classifier (PaddleOCR's
``ch_ppocr_mobile_v2.0_cls``, exported by paddle2onnx: batch ``-1``, open height and width, BatchNorms after
bias-less convs), shipped inside the ``rapidocr_onnxruntime`` wheel, through onnxruntime's ``quantize_static`` at its
documented settings (QDQ, per channel, uint8 activations, int8 weights, 16 calibration samples, no pre-processing).

The data is rendered offline: lines of the Python standard library's own source drawn with PIL in DejaVu fonts,
upright or upside down (the classifier's two classes), preprocessed as RapidOCR does (48 x 192, scaled to [-1, 1]).

    pip download --no-deps rapidocr_onnxruntime==1.4.4 -d /tmp/w && unzip -o -q /tmp/w/*.whl -d /tmp/w
    python scripts/real_models/rapidocr_quantize.py /tmp/w/rapidocr_onnxruntime/models/ch_ppocr_mobile_v2.0_cls_infer.onnx

writes ``tests/fixtures/real/rapidocr-cls-quantize-static.onnx``. The test suite renders its own inputs with
:func:`text_lines`.
"""

from __future__ import annotations

import argparse
import inspect
import random
from pathlib import Path

import numpy as np

FONTS = [f"/usr/share/fonts/truetype/dejavu/{name}.ttf" for name in ("DejaVuSans", "DejaVuSerif", "DejaVuSansMono")]
FIXTURE = Path(__file__).parents[2] / "tests" / "fixtures" / "real" / "rapidocr-cls-quantize-static.onnx"
WIDTH = 192


SOURCES = ("json.decoder", "os")  # the modules whose source lines are drawn: calibration and judging
TRAINING_SOURCES = ("argparse", "textwrap", "pathlib", "csv")  # other text, for training (QAT) only


def _source_lines(modules: tuple[str, ...]) -> list[str]:
    import importlib

    text = "".join(inspect.getsource(importlib.import_module(name)) for name in modules)
    return [line.strip() for line in text.splitlines() if 12 < len(line.strip()) < 40]


def text_lines(count: int, seed: int, modules: tuple[str, ...] = SOURCES) -> tuple[np.ndarray, np.ndarray]:
    """``count`` rendered lines of ``modules``' source as the classifier's input ``[count, 3, 48, 192]`` and their
    labels (1: upside down)."""
    from PIL import Image, ImageDraw, ImageFont

    rng, lines = random.Random(seed), _source_lines(modules)
    if modules != SOURCES:  # training text holds no line the models are judged on
        judged = set(_source_lines(SOURCES))
        lines = [line for line in lines if line not in judged]
    fonts = [f for f in FONTS if Path(f).exists()]
    images, labels = [], []
    for _ in range(count):
        font = ImageFont.truetype(rng.choice(fonts), 28) if fonts else ImageFont.load_default()
        text, flipped = rng.choice(lines), rng.random() < 0.5
        image = Image.new("RGB", (int(font.getlength(text)) + 16, 44), (255, 255, 255))
        ImageDraw.Draw(image).text((8, 6), text, font=font, fill=(0, 0, 0))
        if flipped:
            image = image.rotate(180)
        width = min(WIDTH, int(image.width * 48 / image.height))
        array = (np.asarray(image.resize((width, 48)), np.float32) / 255 - 0.5) / 0.5
        padded = np.zeros((3, 48, WIDTH), np.float32)
        padded[:, :, :width] = array.transpose(2, 0, 1)
        images.append(padded)
        labels.append(int(flipped))
    return np.stack(images), np.array(labels)


def text_pages(count: int, seed: int, size: int = 320) -> np.ndarray:
    """``count`` pages of source lines, ``size`` pixels square, in fonts of three sizes at random margins, as the
    text detector's input ``[count, 3, size, size]`` (ImageNet's mean and deviation, as RapidOCR normalises)."""
    from PIL import Image, ImageDraw, ImageFont

    rng, lines = random.Random(seed), _source_lines(SOURCES)
    fonts = [f for f in FONTS if Path(f).exists()]
    mean, std = np.array([0.485, 0.456, 0.406], np.float32), np.array([0.229, 0.224, 0.225], np.float32)
    pages = []
    for _ in range(count):
        image = Image.new("RGB", (size, size), (255, 255, 255))
        draw, y = ImageDraw.Draw(image), 8
        while y < size - 30:
            size_pt = rng.choice([14, 18, 22])
            font = ImageFont.truetype(rng.choice(fonts), size_pt) if fonts else ImageFont.load_default()
            draw.text((rng.randint(4, 40), y), rng.choice(lines), font=font, fill=(0, 0, 0))
            y += rng.randint(24, 40)
        pages.append(((np.asarray(image, np.float32) / 255 - mean) / std).transpose(2, 0, 1))
    return np.stack(pages).astype(np.float32)


def rendered_inputs(model: str | Path, count: int, seed: int) -> np.ndarray:
    """``count`` rendered inputs of the kind ``model`` reads: pages for the detector (``det`` in its file name),
    lines for the classifier and the recognizer."""
    return text_pages(count, seed) if "det" in Path(model).name else text_lines(count, seed)[0]


def calibration_for(model: str | Path) -> np.ndarray:
    """The 16 calibration inputs (seed 1) every quantizer of ``model`` is given."""
    return rendered_inputs(model, 16, seed=1)


def quantize_rendered(model: str | Path, output: str | Path) -> Path:
    """``model`` through ``quantize_static`` at its documented settings (QDQ, per channel, uint8 activations, int8
    weights), calibrated on 16 rendered inputs (:func:`calibration_for`), no pre-processing; its input takes them
    whatever its name."""
    import onnxruntime as ort
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static

    calibration = calibration_for(model)
    name = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"]).get_inputs()[0].name

    class Reader(CalibrationDataReader):
        def __init__(self):
            self.batches = iter([{name: calibration[i:i + 1]} for i in range(len(calibration))])

        def get_next(self):
            return next(self.batches, None)

    quantize_static(str(model), str(output), Reader(), quant_format=QuantFormat.QDQ, per_channel=True,
                    activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8)
    return Path(output)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="ch_ppocr_mobile_v2.0_cls_infer.onnx from the rapidocr_onnxruntime wheel")
    parser.add_argument("--output", default=str(FIXTURE))
    args = parser.parse_args()
    print(f"wrote {quantize_rendered(args.model, args.output)}")


if __name__ == "__main__":
    main()
