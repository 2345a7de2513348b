"""TensorFlow Model Optimization's documented QAT flow at its defaults, exported by tf2onnx, into
tests/fixtures/interop/tfmot-{small-resnet,mobilenetv2}.onnx, and its documented deployment (the TFLite int8 model)
through tf2onnx into tflite-{small-resnet,mobilenetv2}.onnx: where a Keras 2 (tf-keras) user's quantized model comes
from. The second model is keras.applications' own MobileNetV2 (alpha 0.35, 96x96).

``common.py``'s SmallResNet layer for layer in Keras (channels last: a stem conv, four stages of one BasicBlock,
widths 16 to 128, 32x32 inputs, 10 classes), trained a few steps on the same kind of class templates plus noise,
quantized by ``tfmot.quantization.keras.quantize_model`` (its default 8-bit scheme: int8 weights per channel,
narrow range; asymmetric 8-bit activations), fine-tuned a few steps (QAT) and converted by
``tf2onnx.convert.from_keras`` (opset 13, the batch left dynamic): tf2onnx writes tfmot's ``FakeQuantWithMinMaxVars``
as QuantizeLinear/DequantizeLinear. The same QAT model through ``tf.lite.TFLiteConverter`` with
``optimizations=[tf.lite.Optimize.DEFAULT]`` is TFLite's integer model (int8 activations with zero points, int8
weights per channel, int32 biases), which ``tf2onnx.convert.from_tflite`` writes as QDQ. tfmot runs on tf-keras only
(it switches a process to legacy Keras), so this runs
in an environment of its own, never ``.venv``:

    python -m venv /tmp/tfmot_venv && /tmp/tfmot_venv/bin/pip install "tensorflow-cpu==2.21.*" "tf-keras==2.21.*" \\
        tensorflow-model-optimization==0.8.1 tf2onnx==1.17.0 onnx
    /tmp/tfmot_venv/bin/python scripts/interop_exports/tfmot_export.py
"""

import os
import tempfile
from pathlib import Path

os.environ["TF_USE_LEGACY_KERAS"] = "1"
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np
import tensorflow as tf
import tensorflow_model_optimization as tfmot
import tf2onnx
import tf_keras as keras

FIXTURES = Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "interop"
SIZE, CLASSES = 32, 10
QAT_STEPS = 1500  # its activation ranges are moving averages (decay 0.999) from [-6, 6]: long enough to settle
MOBILENET_QAT_STEPS = 1000  # the same for keras.applications.MobileNetV2, 9x the ResNet's time a step


def conv_bn(x, filters, stride, relu=True, size=3):
    x = keras.layers.Conv2D(filters, size, stride, padding="same", use_bias=False)(x)
    x = keras.layers.BatchNormalization()(x)
    return keras.layers.ReLU()(x) if relu else x


def small_resnet() -> keras.Model:
    """common.SmallResNet in Keras: ResNet-18's stem and four stages of BasicBlocks at 1/4 width."""
    inputs = keras.Input((SIZE, SIZE, 3), name="input")
    x = conv_bn(inputs, 16, 1)
    cin = 16
    for cout, stride in ((16, 1), (32, 2), (64, 2), (128, 2)):
        shortcut = x if stride == 1 and cin == cout else conv_bn(x, cout, stride, relu=False, size=1)
        y = conv_bn(conv_bn(x, cout, stride), cout, 1, relu=False)
        x = keras.layers.ReLU()(keras.layers.Add()([y, shortcut]))
        cin = cout
    x = keras.layers.GlobalAveragePooling2D()(x)
    return keras.Model(inputs, keras.layers.Dense(CLASSES)(x))


def batches(steps: int, seed: int, size: int):
    """(images, labels): class templates plus noise, as common.trained draws them."""
    rng = np.random.default_rng(0)
    templates = rng.standard_normal((CLASSES, size, size, 3)).astype(np.float32)
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        y = rng.integers(0, CLASSES, 32)
        yield templates[y] + 0.5 * rng.standard_normal((32, size, size, 3)).astype(np.float32), y


def train(model: keras.Model, steps: int, seed: int, lr: float = 0.05) -> keras.Model:
    size = model.input_shape[1]
    logits = model.layers[-1].get_config().get("activation") != "softmax"
    model.compile(keras.optimizers.SGD(lr, momentum=0.9), keras.losses.SparseCategoricalCrossentropy(from_logits=logits))
    for x, y in batches(steps, seed, size):
        model.train_on_batch(x, y)
    return model


def export(qat: keras.Model, stem: str) -> None:
    """``qat`` by tf2onnx into ``tfmot-<stem>.onnx``, and as TFLite's integer model into ``tflite-<stem>.onnx``."""
    size = qat.input_shape[1]
    path = FIXTURES / f"tfmot-{stem}.onnx"
    tf2onnx.convert.from_keras(qat, input_signature=[tf.TensorSpec((None, size, size, 3), tf.float32, name="input")],
                               opset=13, output_path=str(path))
    print("wrote", path)
    converter = tf.lite.TFLiteConverter.from_keras_model(qat)
    converter.optimizations = [tf.lite.Optimize.DEFAULT]
    with tempfile.TemporaryDirectory() as tmp:
        tflite = Path(tmp) / "model.tflite"
        tflite.write_bytes(converter.convert())
        path = FIXTURES / f"tflite-{stem}.onnx"
        tf2onnx.convert.from_tflite(str(tflite), opset=13, output_path=str(path))
    print("wrote", path)


FIXTURES.mkdir(parents=True, exist_ok=True)
keras.utils.set_random_seed(0)
model = train(small_resnet(), steps=20, seed=0)
export(train(tfmot.quantization.keras.quantize_model(model), steps=QAT_STEPS, seed=1), "small-resnet")  # QAT
# keras.applications' own MobileNetV2 (depthwise convs, ReLU6, stride-2 blocks padded by ZeroPadding2D), the
# smallest width, 96x96 inputs, 10 classes, random weights
keras.utils.set_random_seed(0)
model = keras.applications.MobileNetV2(input_shape=(96, 96, 3), alpha=0.35, weights=None, classes=CLASSES)
model = train(model, steps=20, seed=0, lr=0.02)
export(train(tfmot.quantization.keras.quantize_model(model), steps=MOBILENET_QAT_STEPS, seed=1, lr=0.02), "mobilenetv2")
