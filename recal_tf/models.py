"""Models built from ``tf.compat.v1.get_variable`` and ``tf.nn`` (``tf.compat.v1.layers`` is gone in Keras 3)."""

from __future__ import annotations

import tensorflow as tf

from .utils import tf_compat


def _he():
    return tf_compat.variance_scaling_initializer(scale=2.0, mode="fan_in", distribution="truncated_normal")


def _conv(x: tf.Tensor, name: str, filters: int, kernel: int, stride: int, initializer=None) -> tf.Tensor:
    with tf_compat.variable_scope(name):
        with tf_compat.variable_scope("conv"):
            weight = tf_compat.get_variable(
                "weight", [kernel, kernel, int(x.shape[-1]), filters],
                initializer=initializer or tf_compat.glorot_uniform_initializer())
            bias = tf_compat.get_variable("bias", [filters], initializer=tf_compat.zeros_initializer())
            y = tf.nn.bias_add(tf.nn.conv2d(x, weight, strides=[1, stride, stride, 1], padding="SAME"), bias)
        return tf.nn.relu(y, name="relu")


def _torch_default():
    """PyTorch's default conv/linear initialisation, U(-1/sqrt(fan_in), 1/sqrt(fan_in)), so the digits
    networks of both backends start alike (with BatchNorm the weight scale sets the effective LR)."""
    return tf_compat.variance_scaling_initializer(scale=1.0 / 3.0, mode="fan_in", distribution="uniform")


def _dense(x: tf.Tensor, name: str, units: int, initializer=None) -> tf.Tensor:
    with tf_compat.variable_scope(name):
        weight = tf_compat.get_variable("weight", [int(x.shape[-1]), units],
                                        initializer=initializer or tf_compat.glorot_uniform_initializer())
        bias = tf_compat.get_variable("bias", [units], initializer=tf_compat.zeros_initializer())
        return tf.nn.bias_add(tf.matmul(x, weight), bias)


def mnist_net(inputs: tf.Tensor, num_classes: int = 10) -> tf.Tensor:
    """A small CNN for ``[N, 28, 28, 1]`` inputs; returns logits (the tensor ``mnist_net/logits``).

    Parameters: ``mnist_net/blocks/conv0/conv/{weight,bias}``, ``mnist_net/blocks/conv1/conv/...``,
    ``mnist_net/dense/fc/{weight,bias}``; so ``re:.*/conv`` selects the two conv layers.
    """
    with tf_compat.variable_scope("mnist_net", reuse=tf_compat.AUTO_REUSE):
        with tf_compat.variable_scope("blocks"):
            x = _conv(inputs, "conv0", 16, 5, 2)
            x = _conv(x, "conv1", 32, 5, 2)
        with tf_compat.variable_scope("dense"):
            x = tf.reshape(x, [-1, int(x.shape[1]) * int(x.shape[2]) * int(x.shape[3])])
            logits = _dense(x, "fc", num_classes, _torch_default())
        return tf.identity(logits, name="logits")


def _batch_norm(x: tf.Tensor, training: tf.Tensor, momentum: float = 0.9, epsilon: float = 1e-5) -> tf.Tensor:
    """Batch normalization (NHWC): batch statistics while ``training``, moving averages otherwise.

    The moving-average updates go to ``tf.compat.v1.GraphKeys.UPDATE_OPS``; run them with the train op.
    """
    channels = int(x.shape[-1])
    with tf_compat.variable_scope("bn"):
        gamma = tf_compat.get_variable("gamma", [channels], initializer=tf_compat.ones_initializer())
        beta = tf_compat.get_variable("beta", [channels], initializer=tf_compat.zeros_initializer())
        mean = tf_compat.get_variable("moving_mean", [channels], initializer=tf_compat.zeros_initializer(),
                                      trainable=False)
        variance = tf_compat.get_variable("moving_variance", [channels], initializer=tf_compat.ones_initializer(),
                                          trainable=False)
    y_train, batch_mean, batch_variance = tf_compat.nn.fused_batch_norm(x, gamma, beta, epsilon=epsilon,
                                                                          is_training=True)
    y_infer, _, _ = tf_compat.nn.fused_batch_norm(x, gamma, beta, mean=mean, variance=variance, epsilon=epsilon,
                                                  is_training=False)
    for moving, batch in ((mean, batch_mean), (variance, batch_variance)):
        tf_compat.add_to_collection(tf_compat.GraphKeys.UPDATE_OPS,
                                    moving.assign_sub((moving - batch) * (1.0 - momentum), read_value=False))
    return tf.where(training, y_train, y_infer)


def _conv_bn_relu(x: tf.Tensor, name: str, filters: int, training: tf.Tensor) -> tf.Tensor:
    with tf_compat.variable_scope(name):
        with tf_compat.variable_scope("conv"):
            weight = tf_compat.get_variable("weight", [3, 3, int(x.shape[-1]), filters], initializer=_he())
            y = tf.nn.conv2d(x, weight, strides=[1, 1, 1, 1], padding="SAME")
        return tf.nn.relu(_batch_norm(y, training), name="relu")


def digits_net(inputs: tf.Tensor, num_classes: int = 10, training: tf.Tensor | None = None) -> tf.Tensor:
    """Conv-BN-ReLU x2, max-pool, Conv-BN-ReLU, global average pool, dense: for ``[N, 8, 8, 1]`` digits
    (the same network as the PyTorch digits net of `recal train`). Returns logits (``digits_net/logits``).

    ``training`` is a boolean tensor (default: a ``placeholder_with_default(False)`` named
    ``digits_net/training``); feed ``True`` while training and run the ``UPDATE_OPS`` with the train op.
    """
    with tf_compat.variable_scope("digits_net", reuse=tf_compat.AUTO_REUSE):
        if training is None:
            training = tf_compat.placeholder_with_default(False, [], name="training")
        with tf_compat.variable_scope("blocks"):
            x = _conv_bn_relu(inputs, "conv0", 32, training)
            x = _conv_bn_relu(x, "conv1", 32, training)
            x = tf.nn.max_pool2d(x, 2, 2, "VALID")
            x = _conv_bn_relu(x, "conv2", 64, training)
        with tf_compat.variable_scope("dense"):
            x = tf.reduce_mean(x, axis=[1, 2])
            logits = _dense(x, "fc", num_classes, _torch_default())
        return tf.identity(logits, name="logits")
