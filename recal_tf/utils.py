"""TensorFlow 1.x-style helpers on TensorFlow 2: ``tf_compat`` and the seed's loss."""

from __future__ import annotations

from recal_keras.quiet_start import import_quietly

tf = import_quietly("tensorflow")  # without its start-up lines (recal_keras.quiet_start)

tf_compat = tf.compat.v1


def batch_cross_entropy_loss(logits: tf.Tensor, labels: tf.Tensor) -> tf.Tensor:
    """Mean softmax cross entropy of ``logits`` against one-hot ``labels``."""
    return tf.reduce_mean(tf.nn.softmax_cross_entropy_with_logits(labels=tf.stop_gradient(labels), logits=logits))
