"""keras.applications' pieces as small functional models, on whichever Keras backend this process runs, and their
run to an int8 model: the blocks :mod:`tests.keras.test_keras_qat_blocks` converts on TensorFlow and :mod:`tests.support.keras_backend_run`
on JAX and PyTorch."""

from __future__ import annotations

from pathlib import Path

import keras
import numpy as np

SPE = 5  # steps per epoch
QAT = """
- !EpochRangeModifier {start_epoch: 0.0, end_epoch: 3.0}
- !GradualKSModifier {params: __ALL_PRUNABLE__, init_sparsity: 0.3, final_sparsity: 0.6, start_epoch: 0.0,
                      end_epoch: 1.0, update_frequency: 0.5}
- !QuantizationModifier {start_epoch: 1.0, freeze_bn_stats_epoch: 2.5}
- !SetLearningRateModifier {learning_rate: 0.005, start_epoch: 1.0}
"""


def mobilenet_block():
    """A MobileNet's pieces: strided stem Conv-BN-ReLU6, ZeroPadding, a strided DepthwiseConv2D-BN-ReLU6,
    Xception's SeparableConv2D-BN-ReLU, a 1x1 projection Conv-BN (no ReLU), global average pooling, Dense."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((16, 16, 3))
    x = keras.layers.Conv2D(8, 3, strides=2, padding="same", use_bias=False, name="stem")(inputs)
    x = keras.layers.ReLU(6.0, name="stem_relu")(keras.layers.BatchNormalization(name="stem_bn")(x))
    x = keras.layers.ZeroPadding2D(1, name="pad")(x)
    x = keras.layers.DepthwiseConv2D(3, strides=2, use_bias=False, name="dw")(x)
    x = keras.layers.ReLU(6.0, name="dw_relu")(keras.layers.BatchNormalization(name="dw_bn")(x))
    x = keras.layers.SeparableConv2D(12, 3, padding="same", use_bias=False, name="sep")(x)
    x = keras.layers.ReLU(name="sep_relu")(keras.layers.BatchNormalization(name="sep_bn")(x))
    x = keras.layers.BatchNormalization(name="project_bn")(keras.layers.Conv2D(16, 1, use_bias=False, name="project")(x))
    x = keras.layers.GlobalAveragePooling2D(name="gap")(x)
    return keras.Model(inputs, keras.layers.Dense(10, name="fc")(x))


def efficientnet_block():
    """EfficientNet's MBConv pieces: a strided stem Conv-BN-swish (an Activation layer), a DepthwiseConv2D-BN-swish,
    squeeze-excitation (global pooling, Reshape, a 1x1 Conv with its own swish, a 1x1 Conv with its own sigmoid,
    Multiply), a linear 1x1 projection, Dropout and the residual Add; global pooling and a Dense."""
    keras.utils.set_random_seed(0)
    layers = keras.layers
    inputs = keras.Input((16, 16, 3))
    x = layers.Conv2D(16, 3, strides=2, padding="same", use_bias=False, name="stem")(inputs)
    x = layers.Activation("swish", name="stem_act")(layers.BatchNormalization(name="stem_bn")(x))
    y = layers.DepthwiseConv2D(3, padding="same", use_bias=False, name="dw")(x)
    y = layers.Activation("swish", name="dw_act")(layers.BatchNormalization(name="dw_bn")(y))
    se = layers.Reshape((1, 1, 16), name="se_reshape")(layers.GlobalAveragePooling2D(name="se_squeeze")(y))
    se = layers.Conv2D(4, 1, activation="swish", name="se_reduce")(se)
    se = layers.Conv2D(16, 1, activation="sigmoid", name="se_expand")(se)
    y = layers.Multiply(name="se_excite")([y, se])
    y = layers.BatchNormalization(name="project_bn")(layers.Conv2D(16, 1, use_bias=False, name="project")(y))
    x = layers.Add(name="add")([layers.Dropout(0.2, name="drop")(y), x])
    x = layers.GlobalAveragePooling2D(name="gap")(x)
    return keras.Model(inputs, layers.Dense(10, name="fc")(x))


def mobilenet_v3_block():
    """MobileNetV3's pieces: a strided stem Conv-BN-hard-swish (an Activation layer), ZeroPadding, a strided
    DepthwiseConv2D-BN-hard-swish, squeeze-excitation with a ReLU and keras.applications' hard-sigmoid gate (ops on
    Keras tensors around a ReLU6 layer: ``ReLU(6)(x + 3) * (1 / 6)``) and Multiply, a linear 1x1 projection with a
    hard-sigmoid of its own (a conv's ``activation``), global pooling and a Dense."""
    keras.utils.set_random_seed(0)
    layers = keras.layers
    inputs = keras.Input((16, 16, 3))
    x = layers.Conv2D(16, 3, strides=2, padding="same", use_bias=False, name="stem")(inputs)
    x = layers.Activation("hard_swish", name="stem_act")(layers.BatchNormalization(name="stem_bn")(x))
    x = layers.ZeroPadding2D(1, name="pad")(x)
    x = layers.DepthwiseConv2D(3, strides=2, use_bias=False, name="dw")(x)
    x = layers.Activation("hard_swish", name="dw_act")(layers.BatchNormalization(name="dw_bn")(x))
    se = layers.GlobalAveragePooling2D(keepdims=True, name="se_squeeze")(x)
    se = layers.Conv2D(8, 1, activation="relu", name="se_reduce")(se)
    se = layers.Conv2D(16, 1, name="se_expand")(se)
    x = layers.Multiply(name="se_excite")([x, layers.ReLU(6.0, name="se_relu6")(se + 3.0) * (1.0 / 6.0)])
    x = layers.Conv2D(16, 1, activation="hard_sigmoid", name="project")(x)
    x = layers.GlobalAveragePooling2D(name="gap")(x)
    return keras.Model(inputs, layers.Dense(10, name="fc")(x))


def densenet_block():
    """DenseNet's pieces: a stem Conv-BN-ReLU and MaxPool, a dense block (pre-activation BN-ReLU-Conv 1x1,
    BN-ReLU-Conv 3x3, concatenated with the block's input), a transition (BN-ReLU-Conv 1x1, AveragePooling), a
    second block, the final BN-ReLU, global pooling and a Dense."""
    keras.utils.set_random_seed(0)
    layers = keras.layers

    def preactivated(x, filters, size, name):
        x = layers.ReLU(name=f"{name}_relu")(layers.BatchNormalization(name=f"{name}_bn")(x))
        return layers.Conv2D(filters, size, padding="same", use_bias=False, name=name)(x)

    inputs = keras.Input((12, 12, 3))
    x = layers.Conv2D(8, 3, padding="same", use_bias=False, name="stem")(inputs)
    x = layers.MaxPooling2D(2, name="pool")(layers.ReLU(name="stem_relu")(layers.BatchNormalization(name="stem_bn")(x)))
    x = layers.Concatenate(name="c1")([x, preactivated(preactivated(x, 16, 1, "b1a"), 4, 3, "b1b")])
    x = layers.AveragePooling2D(2, name="avg")(preactivated(x, 8, 1, "trans"))
    x = layers.Concatenate(name="c2")([x, preactivated(x, 4, 3, "b2")])
    x = layers.ReLU(name="top_relu")(layers.BatchNormalization(name="top_bn")(x))
    return keras.Model(inputs, layers.Dense(10, name="fc")(layers.GlobalAveragePooling2D(name="gap")(x)))


def residual_net():
    """ResNet's stem (ZeroPadding, a 7x7 strided valid Conv-BN-ReLU, ZeroPadding, MaxPool) and block (two 3x3 convs
    and a 1x1 projection shortcut reading the same pooled tensor, Add, ReLU), then MobileNetV2's inverted residual
    (expand 1x1, depthwise, linear projection, Add), global pooling and a softmax Dense."""
    keras.utils.set_random_seed(0)
    layers = keras.layers

    def conv(x, filters, size, name, relu=True, depthwise=False, **kw):
        x = (layers.DepthwiseConv2D(size, padding="same", use_bias=False, name=name) if depthwise else
             layers.Conv2D(filters, size, padding=kw.pop("padding", "same"), use_bias=False, name=name, **kw))(x)
        x = layers.BatchNormalization(name=f"{name}_bn")(x)
        return layers.ReLU(6.0 if relu == 6 else None, name=f"{name}_relu")(x) if relu else x

    inputs = keras.Input((16, 16, 3))
    x = conv(layers.ZeroPadding2D(3, name="stem_pad")(inputs), 8, 7, "stem", strides=2, padding="valid")
    x = layers.MaxPooling2D(3, strides=2, name="pool")(layers.ZeroPadding2D(1, name="pool_pad")(x))
    y = conv(conv(x, 8, 3, "res_a"), 8, 3, "res_b", relu=False)
    x = layers.ReLU(name="add1_relu")(layers.Add(name="add1")([conv(x, 8, 1, "shortcut", relu=False), y]))
    y = conv(conv(conv(x, 16, 1, "expand", relu=6), 0, 3, "dw", relu=6, depthwise=True), 8, 1, "project", relu=False)
    x = layers.Add(name="add2")([x, y])
    x = layers.GlobalAveragePooling2D(name="gap")(x)
    return keras.Model(inputs, layers.Dense(10, activation="softmax", name="fc")(x))


BLOCKS = {"mobilenet": mobilenet_block, "efficientnet": efficientnet_block, "densenet": densenet_block,
          "mobilenet_v3": mobilenet_v3_block}
# what each block's int8 model holds, from any backend's exporter: the convs (a separable conv: two; DenseNet's four
# pre-activation BatchNorms: depthwise convs), swish's and squeeze-excitation's sigmoids and products, merges, pools
INTEGER_OPS = {
    "mobilenet": {"QLinearConv": 5, "QLinearGlobalAveragePool": 1, "QGemm": 1},
    "efficientnet": {"QLinearConv": 5, "QLinearSigmoid": 4, "QLinearMul": 4, "QLinearAdd": 1,
                     "QLinearGlobalAveragePool": 2, "QGemm": 1},
    "densenet": {"QLinearConv": 9, "QLinearConcat": 2, "QLinearAveragePool": 1, "QLinearGlobalAveragePool": 1,
                 "QGemm": 1},
    "residual": {"QLinearConv": 7, "QLinearAdd": 2, "QLinearGlobalAveragePool": 1, "QGemm": 1},
    "mobilenet_v3": {"QLinearConv": 5, "QLinearMul": 1, "QLinearGlobalAveragePool": 2, "QGemm": 1},
}
# the activations each block's int8 model looks up in a table of integers (``unary_to_table``): MobileNetV3's
# hard-swish (stem, dw), its gate's ops and the projection's hard-sigmoid
TABLES = {"mobilenet_v3": 4}


def block_to_int8(net: keras.Model, folder: Path, recipe: str = QAT) -> tuple:
    """``net`` under ``recipe`` (:data:`QAT`) with ``fit`` on random inputs, finalized, exported with this backend's
    exporter and converted (verified on those inputs): ``(manager, feeds, the Keras QAT model's outputs, the
    conversion's result, its op types)``."""
    import onnx

    from recal_onnx import quantize_qat_export
    from recal_keras import ScheduledModifierManager, export_onnx

    manager = ScheduledModifierManager.from_yaml(recipe)
    optimizer = keras.optimizers.SGD(0.01, momentum=0.9)
    model, callbacks = manager.modify(net, optimizer, steps_per_epoch=SPE)
    model.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x = np.random.default_rng(0).standard_normal((SPE * 32, *net.input_shape[1:])).astype(np.float32)
    y = np.random.default_rng(1).integers(0, 10, SPE * 32)
    model.fit(x, y, batch_size=32, epochs=3, callbacks=callbacks, verbose=0, shuffle=False)
    manager.finalize(model)
    expected = np.asarray(model.predict(x, verbose=0))
    path = export_onnx(model, Path(folder) / "qat.onnx")
    feeds = {onnx.load(path).graph.input[0].name: x}
    result = quantize_qat_export(path, Path(folder) / "int8.onnx", verify_inputs=feeds)
    return manager, feeds, expected, result, [n.op_type for n in result.model.graph.node]
