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


def _dense(x: tf.Tensor, name: str, units: int) -> tf.Tensor:
    with tf_compat.variable_scope(name):
        weight = tf_compat.get_variable("weight", [int(x.shape[-1]), units],
                                        initializer=tf_compat.glorot_uniform_initializer())
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
            logits = _dense(x, "fc", num_classes)
        return tf.identity(logits, name="logits")


def digits_net(inputs: tf.Tensor, num_classes: int = 10) -> tf.Tensor:
    """A small CNN for the ``[N, 8, 8, 1]`` digits; returns logits (the tensor ``digits_net/logits``)."""
    with tf_compat.variable_scope("digits_net", reuse=tf_compat.AUTO_REUSE):
        with tf_compat.variable_scope("blocks"):
            x = _conv(inputs, "conv0", 32, 3, 1, _he())
            x = _conv(x, "conv1", 32, 3, 1, _he())
            x = tf.nn.max_pool2d(x, 2, 2, "VALID")
            x = _conv(x, "conv2", 64, 3, 1, _he())
        with tf_compat.variable_scope("dense"):
            x = tf.reduce_mean(x, axis=[1, 2])
            logits = _dense(x, "fc", num_classes)
        return tf.identity(logits, name="logits")
