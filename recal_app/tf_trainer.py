"""The TensorFlow trainer behind ``recal train --framework tf``: the digits classifier under a recipe.

A ``tf.compat.v1`` graph with the seed's API: ``create_ops``, one ``train_op_with_ops`` per step,
summaries to TensorBoard, a ``Saver`` checkpoint per epoch (``--resume`` restores the last one and
continues the schedule exactly), and at the end ``complete_graph``, a frozen inference graph and its ONNX export
(QDQ after QAT, which ``recal train`` then converts to int8).
"""

from __future__ import annotations

import json
import logging
import math
import statistics
from pathlib import Path

import numpy as np
import tensorflow as tf

from recal_core.atomic import atomic_path, write_text_atomically
from recal_core.datasets import load_digits
from recal_core.recipe import Recipe
from .run_lock import read_resume_record, restore_checkpoint
from .training import (BATCH_SIZE, LEARNING_RATE, Artefact, EpochRecord, TrainingRun, check_finite, epoch_line,
                        epoch_order, median_latency_ms, overall_sparsity, progress_bar)

from recal_tf.graph import (EXTRAS_KEY_LEARNING_RATE, EXTRAS_KEY_WEIGHT_DECAY, ScheduledModifierManager,
                            describe_variables, frozen_graph_def, graph_def_to_onnx)
from recal_tf.models import digits_net
from recal_tf.utils import batch_cross_entropy_loss, tf_compat

log = logging.getLogger(__name__)

def _kernel_sparsity(values: dict[str, np.ndarray]) -> tuple[float, dict[str, float]]:
    layers = {name: float((v == 0).sum()) / v.size for name, v in values.items()}
    return overall_sparsity(layers, {name: v.size for name, v in values.items()}), layers


def _read_history(ckpt_dir: Path) -> dict:
    path = ckpt_dir / "history.json"
    state = read_resume_record(path, ("epoch", "checkpoint", "history"))
    if not (ckpt_dir / (state["checkpoint"] + ".index")).is_file() or "/" in state["checkpoint"]:
        raise FileNotFoundError(f"--resume: {path} names checkpoint {state['checkpoint']!r}, which is not in "
                                f"{ckpt_dir}")
    return state


def train(recipe: Recipe, out_dir: Path, *, epochs: int, seed: int, resume: bool, progress: bool) -> TrainingRun:
    tf.get_logger().setLevel(logging.ERROR)  # TF's notices that v1 graph APIs are deprecated
    digits = load_digits()
    x_train, y_train = digits.train_images[..., None], digits.train_labels
    x_test, y_test = digits.test_images[..., None], digits.test_labels
    steps_per_epoch = math.ceil(len(x_train) / BATCH_SIZE)
    run = TrainingRun("tf", recipe.source, str(out_dir), epochs, seed, steps_per_epoch)
    graph = tf_compat.Graph()
    with graph.as_default():
        tf_compat.set_random_seed(seed)
        inputs = tf_compat.placeholder(tf.float32, [None, 8, 8, 1], name="inputs")
        labels = tf_compat.placeholder(tf.int64, [None], name="labels")
        training = tf_compat.placeholder_with_default(False, [], name="training")
        logits = digits_net(inputs, training=training)
        loss = batch_cross_entropy_loss(logits, tf.one_hot(labels, 10))
        global_step = tf_compat.train.get_or_create_global_step()
        infos, variables = describe_variables(graph, tf_compat.trainable_variables())  # before QAT rewires the graph
        kernels = {p.name: variables[p.name] for p in infos if p.prunable}  # as the core selects them
        manager = ScheduledModifierManager(recipe)
        mod_ops, extras = manager.create_ops(steps_per_epoch=steps_per_epoch, base_lr=LEARNING_RATE)
        total_loss = loss + extras[EXTRAS_KEY_WEIGHT_DECAY] if EXTRAS_KEY_WEIGHT_DECAY in extras else loss
        lr = extras.get(EXTRAS_KEY_LEARNING_RATE, tf.constant(LEARNING_RATE))
        with tf_compat.control_dependencies(tf_compat.get_collection(tf_compat.GraphKeys.UPDATE_OPS)):
            optimizer = tf_compat.train.MomentumOptimizer(lr, 0.9)
            grads = optimizer.compute_gradients(total_loss, var_list=tf_compat.trainable_variables())
            train_op = optimizer.apply_gradients(manager.mask_gradients(grads), global_step=global_step)
        step_op = manager.train_op_with_ops(train_op)
        summaries = tf_compat.summary.merge_all()
        saver = tf_compat.train.Saver(max_to_keep=3)
        init = tf_compat.global_variables_initializer()
    with graph.as_default():  # Saver, FileWriter and session ops need the graph as default under TF2
        ckpt_dir = out_dir / "checkpoints"
        sess = tf_compat.Session(graph=graph)
        start = 0
        if resume:
            # history.json is the commit point: it names the checkpoint of the last complete epoch (a
            # checkpoint saved after it, by a run killed before history.json was written, is ignored)
            state = _read_history(ckpt_dir)
            restore_checkpoint(lambda: saver.restore(sess, str(ckpt_dir / state["checkpoint"])),
                               ckpt_dir / state["checkpoint"])
            manager.initialize_session(sess)
            run.history = [EpochRecord(**h) for h in state["history"]]
            start = state["epoch"]
        else:
            sess.run(init)
            manager.initialize_session(sess)
        ckpt_dir.mkdir(parents=True, exist_ok=True)
        writer = tf_compat.summary.FileWriter(str(out_dir / "tensorboard"), graph)
        try:
            for epoch in range(start, epochs):
                order = epoch_order(len(x_train), seed, epoch)
                bar = progress_bar(range(steps_per_epoch), f"tf epoch {epoch + 1}/{epochs}", progress)
                losses, correct = [], 0
                for b in bar:
                    index = order[b * BATCH_SIZE:(b + 1) * BATCH_SIZE]
                    feed = {inputs: x_train[index], labels: y_train[index], training: True}
                    fetches = [step_op, loss, logits, summaries, global_step]
                    _, batch_loss, batch_logits, summary, step = sess.run(fetches, feed)
                    writer.add_summary(summary, step)
                    losses.append(float(batch_loss))
                    check_finite("tf", int(step), losses[-1])
                    correct += int((batch_logits.argmax(1) == y_train[index]).sum())
                    if b % 5 == 0 or b == steps_per_epoch - 1:
                        bar.set_postfix(loss=f"{statistics.fmean(losses):.3f}",
                                        sparsity=f"{_kernel_sparsity(sess.run(kernels))[0]:.3f}",
                                        lr=f"{float(sess.run(lr)):.4g}")
                test_logits = sess.run(logits, {inputs: x_test})
                record = EpochRecord(epoch + 1, statistics.fmean(losses), correct / len(x_train),
                                     float((test_logits.argmax(1) == y_test).mean()),
                                     _kernel_sparsity(sess.run(kernels))[0], float(sess.run(lr)))
                check_finite("tf", (epoch + 1) * steps_per_epoch, weights=sess.run(tf_compat.trainable_variables()))
                run.history.append(record)
                prefix = saver.save(sess, str(ckpt_dir / "model.ckpt"), global_step=epoch + 1)
                write_text_atomically(ckpt_dir / "history.json", json.dumps(
                    {"epoch": epoch + 1, "checkpoint": Path(prefix).name, "history": [vars(h) for h in run.history]}))
                if progress:  # after the commit point: a printed epoch is a saved one
                    print(epoch_line("tf", record, epochs), flush=True)
            writer.flush()
            manager.complete_graph(graph, sess)
            frozen = frozen_graph_def(sess, ["digits_net/logits:0"], ["inputs:0"])  # one freeze: .pb and ONNX
            overall, layers = _kernel_sparsity(sess.run(kernels))
            accuracy = float((sess.run(logits, {inputs: x_test}).argmax(1) == y_test).mean())
        finally:
            writer.close()
            sess.close()
    onnx_path = graph_def_to_onnx(frozen, out_dir / "model.onnx", ["inputs:0"], ["digits_net/logits:0"])
    quantized = bool(manager.quantized_ops)
    run.artefacts = [_frozen_artefact(frozen, out_dir, x_test, accuracy, overall, layers),
                     Artefact(("QAT ONNX export (QDQ)" if quantized else "ONNX export (fp32)") + " of the TF graph",
                              "tf", onnx_path, sparsity=overall, layer_sparsity=layers, qat=quantized)]
    return run


def _frozen_artefact(frozen, out_dir: Path, x_test: np.ndarray, accuracy: float, overall: float,
                     layers: dict[str, float]) -> Artefact:
    path = out_dir / "model.pb"
    with atomic_path(path) as tmp:
        tmp.write_bytes(frozen.SerializeToString())
    with tf_compat.Graph().as_default() as inference, tf_compat.Session(graph=inference) as sess:
        tf_compat.import_graph_def(frozen, name="")
        one = {"inputs:0": x_test[:1]}
        latency = median_latency_ms(lambda: sess.run("digits_net/logits:0", one))
        frozen_accuracy = float((sess.run("digits_net/logits:0", {"inputs:0": x_test}).argmax(1)
                                 == load_digits().test_labels).mean())
    if abs(frozen_accuracy - accuracy) > 1e-9:
        log.warning("frozen graph accuracy %.4f differs from the session's %.4f", frozen_accuracy, accuracy)
    return Artefact("TensorFlow frozen graph (GraphDef)", "tf", str(path), frozen_accuracy, overall, layers,
                    path.stat().st_size, latency, f"tensorflow {tf.__version__}")
