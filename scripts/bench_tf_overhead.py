"""Step time of the seed's mnist_net (batch 128) in TensorFlow: plain vs with recal's pruning ops.

Reports the median time of ``sess.run(train_op)`` alone, of ``train_op`` then ``mod_ops`` between
mask updates (the common case), at steps where every mask is recomputed, and of the single op from
``manager.train_op_with_ops(train_op)`` (one session call per step).

    python scripts/bench_tf_overhead.py [--steps 100]
"""

from __future__ import annotations

import argparse

import numpy as np

from recal_tf import ScheduledModifierManager
from recal_tf.models import mnist_net
from recal_tf.utils import batch_cross_entropy_loss, tf_compat

from bench.results import machine
from bench.timing import interleaved, medians

BETWEEN = """
- !EpochRangeModifier {start_epoch: 0, end_epoch: 100}
- !GradualKSModifier {params: __ALL__, init_sparsity: 0.5, final_sparsity: 0.9, start_epoch: 0, end_epoch: 90,
                      update_frequency: 10}
"""
EVERY_STEP = BETWEEN.replace("update_frequency: 10", "update_frequency: -1")


def _build(recipe: str | None, fused: bool = False):
    graph = tf_compat.Graph()
    with graph.as_default():
        tf_compat.set_random_seed(0)
        inputs = tf_compat.placeholder(tf_compat.float32, [None, 28, 28, 1])
        labels = tf_compat.placeholder(tf_compat.float32, [None, 10])
        loss = batch_cross_entropy_loss(mnist_net(inputs), labels)
        global_step = tf_compat.train.get_or_create_global_step()
        ops = []
        if recipe:
            manager = ScheduledModifierManager.from_yaml(recipe)
            ops, _ = manager.create_ops(steps_per_epoch=10)
        train_op = tf_compat.train.AdamOptimizer(1e-4).minimize(loss, global_step=global_step)
        if fused:
            train_op, ops = manager.train_op_with_ops(train_op), []
        init = tf_compat.global_variables_initializer()
    sess = tf_compat.Session(graph=graph)
    sess.run(init)
    return sess, train_op, ops, inputs, labels


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    feed_x = rng.random((128, 28, 28, 1), dtype=np.float32)
    feed_y = np.eye(10, dtype=np.float32)[rng.integers(0, 10, 128)]
    variants = {"plain": _build(None), "recal, between updates": _build(BETWEEN),
                "recal, update every step": _build(EVERY_STEP),
                "recal fused, between updates": _build(BETWEEN, fused=True)}
    def step(sess, train_op, ops, x, y):
        sess.run(train_op, {x: feed_x, y: feed_y})
        if ops:
            sess.run(ops)

    # one step of each variant per round, in turn, so drift affects all alike
    ms = medians(interleaved({name: lambda v=v: step(*v) for name, v in variants.items()}, args.steps, warmup=5), 1e3)
    sess, _, ops, _, _ = variants["recal, between updates"]
    alone = medians(interleaved({"recal ops alone (between)": lambda: sess.run(ops)}, args.steps, warmup=0), 1e3)
    print(f"\nmnist_net, batch 128, {machine()['cpu']}, median of {args.steps} interleaved steps")
    print(f"{'variant':28s} {'ms/step':>9s} {'overhead':>9s}")
    for name, value in ms.items():
        print(f"{name:28s} {value:9.2f} {100 * (value / ms['plain'] - 1):+8.1f}%")
    for name, value in alone.items():  # the recal ops alone (between updates), timed apart from the step
        print(f"{name:28s} {value:9.2f} {100 * value / ms['plain']:+8.1f}%")

if __name__ == "__main__":
    main()
