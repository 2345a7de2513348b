"""The seed document's TensorFlow example, as written, on the bundled digits.

Only the imports differ: ``neuralmagicML.tensorflow.*`` is ``recal_tf.*``, and the removed
``tensorflow.examples.tutorials.mnist.input_data`` is ``recal_tf.input_data``.

    python scripts/examples/seed_tf.py [RECIPE]     (default: recal:seed_prune_all)
"""

import math
import sys

from recal_tf import input_data
from recal_tf.utils import tf_compat, batch_cross_entropy_loss
from recal_tf.models import mnist_net
from recal_tf import ScheduledModifierManager

CONFIG = sys.argv[1] if len(sys.argv) > 1 else "recal:seed_prune_all"

dataset = input_data.read_data_sets("./mnist_data", one_hot=True)
batch_size = 1024
num_batches = int(len(dataset.train.images) / batch_size)

with tf_compat.Graph().as_default() as graph:
    inputs = tf_compat.placeholder(
        tf_compat.float32, [None, 28, 28, 1], name="inputs"
    )
    labels = tf_compat.placeholder(tf_compat.float32, [None, 10])
    logits = mnist_net(inputs)
    loss = batch_cross_entropy_loss(logits, labels)

    global_step = tf_compat.train.get_or_create_global_step()
    manager = ScheduledModifierManager.from_yaml(CONFIG)
    mod_ops, mod_extras = manager.create_ops(steps_per_epoch=math.ceil(len(dataset.train.images) / batch_size))

    train_op = tf_compat.train.AdamOptimizer(learning_rate=1e-4).minimize(
        loss, global_step=global_step
    )

    with tf_compat.Session() as sess:
        sess.run(tf_compat.global_variables_initializer())

        for epoch in range(manager.max_epochs):
            for batch in range(num_batches):
                batch_xs, batch_ys = dataset.train.next_batch(batch_size)
                batch_xs = batch_xs.reshape([-1, 28, 28, 1])
                sess.run(train_op, feed_dict={inputs: batch_xs, labels: batch_ys})
                sess.run(mod_ops)

        # Not in the seed: report what training achieved.
        test_logits = sess.run(logits, {inputs: dataset.test.images.reshape([-1, 28, 28, 1])})
        accuracy = (test_logits.argmax(1) == dataset.test.labels.argmax(1)).mean()
        sparsity = manager.complete_graph()
        print(f"test accuracy {accuracy:.4f}")
        for name, value in sparsity.items():
            print(f"sparsity {name} {value:.4f}")
