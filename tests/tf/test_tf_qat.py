"""QAT in the TensorFlow graph API: the forward graph rewired by create_ops, exported to QDQ, converted to int8."""

import math

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
pytest.importorskip("tf2onnx")

from recal_core import RecipeError  # noqa: E402
from recal_core.datasets import load_digits  # noqa: E402
from recal_onnx import quantize_qat_export  # noqa: E402
from recal_tf import EXTRAS_KEY_UPDATE_OPS, ScheduledModifierManager  # noqa: E402
from recal_tf import export_onnx  # noqa: E402
from recal_tf.models import digits_net, mnist_net  # noqa: E402
from recal_tf.utils import batch_cross_entropy_loss, tf_compat  # noqa: E402

from tests.support.onnx_graphs import assert_biases_on_grid  # noqa: E402

BATCH = 128
QAT = """
- !EpochRangeModifier {start_epoch: 0, end_epoch: 5}
- !GradualKSModifier {params: __ALL_PRUNABLE__, init_sparsity: 0.3, final_sparsity: 0.6, start_epoch: 0,
                      end_epoch: 1, update_frequency: 0.5}
- !QuantizationModifier {start_epoch: 2, freeze_bn_stats_epoch: 3, disable_quantization_observer_epoch: 4,
                         reduce_range: true}
"""
CONVS = [f"digits_net/blocks/conv{i}/conv/Conv2D" for i in range(3)]


def _digits():
    d = load_digits()
    return d.train_images[..., None], d.train_labels, d.test_images[..., None], d.test_labels


def _build(recipe, steps_per_epoch, run_update_ops=True):
    inputs = tf_compat.placeholder(tf.float32, [None, 8, 8, 1], name="inputs")
    labels = tf_compat.placeholder(tf.int64, [None])
    training = tf_compat.placeholder_with_default(False, [], name="training")
    logits = digits_net(inputs, training=training)
    loss = batch_cross_entropy_loss(logits, tf.one_hot(labels, 10))
    global_step = tf_compat.train.get_or_create_global_step()
    manager = ScheduledModifierManager.from_yaml(recipe)
    mod_ops, extras = manager.create_ops(steps_per_epoch=steps_per_epoch)
    updates = tf_compat.get_collection(tf_compat.GraphKeys.UPDATE_OPS) if run_update_ops else []
    with tf_compat.control_dependencies(updates):
        train_op = tf_compat.train.MomentumOptimizer(0.05, 0.9).minimize(loss, global_step=global_step)
    return inputs, labels, training, logits, manager, mod_ops, extras, train_op


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """digits_net pruned then QAT-trained for 5 short epochs, with per-step readings of its QAT state."""
    x_train, y_train, x_test, y_test = _digits()
    spe = math.ceil(len(x_train) / BATCH)
    graph = tf_compat.Graph()
    readings = []
    with graph.as_default():
        tf_compat.set_random_seed(0)
        inputs, labels, training, logits, manager, mod_ops, extras, train_op = _build(QAT, spe)
        variables = {v.op.name: v for v in tf_compat.global_variables()}
        watched = {"observed": variables["qat/digits_net_blocks_conv1_conv_Conv2D_output/observed"],
                   "max": variables["qat/digits_net_blocks_conv1_conv_Conv2D_output/max"],
                   "moving_mean": variables["digits_net/blocks/conv1/bn/moving_mean"],
                   "kernel": variables["digits_net/blocks/conv1/conv/weight"]}
        sess = tf_compat.Session()
        sess.run(tf_compat.global_variables_initializer())
        manager.initialize_session(sess)
        rng = np.random.default_rng(0)
        for _ in range(manager.max_epochs):
            order = rng.permutation(len(x_train))
            for b in range(spe):
                index = order[b * BATCH:(b + 1) * BATCH]
                sess.run(train_op, {inputs: x_train[index], labels: y_train[index], training: True})
                sess.run(mod_ops)
                readings.append(sess.run(watched))
        manager.complete_graph(sess=sess)
        tf_logits = sess.run(logits, {inputs: x_test})
        path = tmp_path_factory.mktemp("graph_qat") / "qat.onnx"
        export_onnx(sess, path, ["inputs:0"], ["digits_net/logits:0"])
        sess.close()
    return {"manager": manager, "spe": spe, "readings": readings, "tf_logits": tf_logits, "path": path,
            "x_test": x_test.astype(np.float32), "y_test": y_test, "extras": extras}


def test_every_conv_and_the_dense_layer_is_quantized(trained):
    assert trained["manager"].quantized_ops == CONVS + ["digits_net/dense/fc/MatMul"]
    # one range each: the image, the three conv outputs (the max-pool passes conv1's on), the pooled features
    # (the global average pool makes new values), the logits
    assert len(trained["extras"][EXTRAS_KEY_UPDATE_OPS]) == 6


def test_observers_and_batchnorm_follow_the_recipe(trained):
    spe, r = trained["spe"], trained["readings"]
    start, freeze_bn, freeze_observers = 2 * spe, 3 * spe, 4 * spe  # reading i is after step i + 1
    assert all(x["observed"] == 0 for x in r[:start])  # QAT off: nothing observed
    assert all(x["observed"] == 1 for x in r[start:])
    maxima = [x["max"] for x in r]
    assert len(set(maxima[start:freeze_observers])) > 1  # the moving average moves...
    assert len(set(maxima[freeze_observers:])) == 1  # ...until disable_quantization_observer_epoch
    means = [x["moving_mean"].tobytes() for x in r]
    assert len(set(means[start:freeze_bn])) > 1
    assert len(set(means[freeze_bn:])) == 1  # freeze_bn_stats_epoch: BatchNorm statistics no longer move
    for x in r[spe:]:  # pruning done at epoch 1, kept through QAT
        assert (x["kernel"] == 0).mean() == pytest.approx(0.6, abs=1e-3)


def test_export_is_folded_per_channel_qdq_and_int8_matches_tensorflow(trained, tmp_path):
    model = onnx.load(str(trained["path"]))
    ops = [n.op_type for n in model.graph.node]
    assert "BatchNormalization" not in ops and ops.count("Conv") == 3  # BatchNorm folded, training path gone
    init = {i.name: onnx.numpy_helper.to_array(i) for i in model.graph.initializer}
    weight_scales = [init[n.input[1]] for n in model.graph.node if n.op_type == "DequantizeLinear"
                     and n.input[1] in init and init[n.input[1]].ndim == 1]
    assert sorted(s.size for s in weight_scales) == [10, 32, 32, 64]  # int8 per output channel
    assert_biases_on_grid(model, 4)  # each bias on its int32 grid: the conversion adds no rounding
    result = quantize_qat_export(trained["path"], tmp_path / "int8.onnx")
    print(f"TF graph QAT digits net, int8 vs its QAT export: {result.verification}")
    assert not result.unconverted
    int8 = onnx.load(str(tmp_path / "int8.onnx"))
    assert {"QLinearConv", "QGemm"} <= {n.op_type for n in int8.graph.node} or \
        {"QLinearConv", "QLinearMatMul"} <= {n.op_type for n in int8.graph.node}
    sess = ort.InferenceSession(str(tmp_path / "int8.onnx"))
    logits = sess.run(None, {"inputs:0": trained["x_test"]})[0]
    tf_logits = trained["tf_logits"]
    out_scale = float(np.abs(np.diff(np.unique(tf_logits))).min())  # the TF model's output is fake-quantized
    assert np.abs(logits - tf_logits).max() <= 3 * out_scale + 1e-6
    assert (logits.argmax(1) == tf_logits.argmax(1)).mean() >= 0.99
    tf_accuracy = (tf_logits.argmax(1) == trained["y_test"]).mean()
    assert abs((logits.argmax(1) == trained["y_test"]).mean() - tf_accuracy) <= 2 / len(logits)
    assert tf_accuracy > 0.8
    init = {i.name: onnx.numpy_helper.to_array(i) for i in int8.graph.initializer}
    convs = [n for n in int8.graph.node if n.op_type == "QLinearConv"]
    assert len(convs) == 3
    for conv in convs:  # the pruned weights sit at their zero point: sparsity kept
        w, zero_point = init[conv.input[3]], init[conv.input[5]].reshape(-1, 1, 1, 1)
        assert (w == zero_point).mean() >= 0.6 - 1e-3
    # reduce_range: 7-bit weights, int8 for every target, exact in a default session on any x86 CPU
    assert "within +-64" in result.weights_note and result.weight_type == "int8"  # target any: nothing shifted
    weights = [init[n.input[3]] for n in int8.graph.node if n.op_type in ("QLinearConv", "QGemm")]
    assert {w.dtype.name for w in weights} == {"int8"}
    assert max(int(np.abs(w.astype(np.int16)).max()) for w in weights) == 64
    qat_logits = ort.InferenceSession(str(trained["path"])).run(None, {"inputs:0": trained["x_test"]})[0]
    assert (qat_logits.argmax(1) == tf_logits.argmax(1)).mean() >= 0.99  # the QAT export, default session
    assert np.abs(qat_logits - tf_logits).max() <= 2 * out_scale + 1e-6


def test_observer_updates_that_nothing_runs_are_an_error():
    with tf_compat.Graph().as_default():
        recipe = QAT.replace("start_epoch: 2,", "start_epoch: 0,")
        inputs, labels, training, _, manager, mod_ops, _, train_op = _build(recipe, 3, run_update_ops=False)
        with tf_compat.Session() as sess:
            sess.run(tf_compat.global_variables_initializer())
            with pytest.raises(RuntimeError, match="UPDATE_OPS"):
                manager.initialize_session(sess)
            x_train, y_train, _, _ = _digits()
            sess.run(train_op, {inputs: x_train[:8], labels: y_train[:8], training: True})
            with pytest.raises(tf.errors.InvalidArgumentError, match="never observed"):
                sess.run(mod_ops)  # the seed's loop, sess.run(train_op); sess.run(mod_ops), without UPDATE_OPS


def test_optimizer_built_before_create_ops_is_refused():
    with tf_compat.Graph().as_default():
        inputs = tf_compat.placeholder(tf.float32, [None, 28, 28, 1])
        loss = tf.reduce_mean(mnist_net(inputs))
        tf_compat.train.AdamOptimizer(1e-3).minimize(loss)
        with pytest.raises(RecipeError, match="before optimizer.minimize"):
            ScheduledModifierManager.from_yaml("- !QuantizationModifier {start_epoch: 0}").create_ops(steps_per_epoch=2)


def test_a_graph_with_nothing_to_quantize_is_refused():
    with tf_compat.Graph().as_default():
        inputs = tf_compat.placeholder(tf.float32, [None, 4])
        scale = tf_compat.get_variable("scale", [4])
        tf.reduce_mean(inputs * scale)
        with pytest.raises(RecipeError, match="no Conv2D"):
            ScheduledModifierManager.from_yaml("- !QuantizationModifier {start_epoch: 0}").create_ops(steps_per_epoch=2)


def test_float_ops_and_unfolded_batchnorm_are_named():
    from recal_tf import RecalWarning

    with tf_compat.Graph().as_default():
        inputs = tf_compat.placeholder(tf.float32, [None, 8, 8, 2])
        depthwise = tf_compat.get_variable("dw", [3, 3, 2, 1])
        x = tf.nn.depthwise_conv2d(inputs, depthwise, [1, 1, 1, 1], "SAME", name="depthwise")
        kernel = tf_compat.get_variable("kernel", [3, 3, 2, 4])
        x = tf.nn.conv2d(x, kernel, 1, "SAME", name="conv")
        x, _, _ = tf_compat.nn.fused_batch_norm(x, tf.ones([4]), tf.zeros([4]), is_training=True)  # no moving stats
        tf.reduce_mean(x)
        manager = ScheduledModifierManager.from_yaml("- !QuantizationModifier {start_epoch: 0}")
        with pytest.warns(RecalWarning) as caught:
            manager.create_ops(steps_per_epoch=2)
    text = " ".join(str(w.message) for w in caught)
    assert "depthwise (DepthwiseConv2dNative)" in text and "the BatchNorm after conv is not folded" in text
    assert manager.quantized_ops == ["conv"]


def test_completed_before_qat_ran_is_left_float(tmp_path):
    from recal_tf import RecalWarning

    x_train, y_train, x_test, _ = _digits()
    with tf_compat.Graph().as_default():
        inputs, labels, training, logits, manager, mod_ops, _, train_op = _build(QAT, 3)  # QAT from step 6
        with tf_compat.Session() as sess:
            sess.run(tf_compat.global_variables_initializer())
            manager.initialize_session(sess)
            for b in range(4):
                sess.run(train_op, {inputs: x_train[b * 32:(b + 1) * 32], labels: y_train[b * 32:(b + 1) * 32],
                                    training: True})
                sess.run(mod_ops)
            before = sess.run(logits, {inputs: x_test})
            with pytest.warns(RecalWarning, match="QAT had not run by step 4, so the model is completed float"):
                manager.complete_graph(sess=sess)
            np.testing.assert_array_equal(sess.run(logits, {inputs: x_test}), before)
            export_onnx(sess, tmp_path / "float.onnx", ["inputs:0"], ["digits_net/logits:0"])
    assert manager.quantized_ops == []
    assert not {"QuantizeLinear", "DequantizeLinear"} & {n.op_type for n in onnx.load(str(tmp_path / "float.onnx")).graph.node}


LSQ = QAT.replace("reduce_range: true}", "reduce_range: true,\n  scheme: {input_activations: {symmetric: false, "
                  "observer: lsq}, weights: {observer: lsq}}}")


def _steps(sess, built, x_train, y_train, spe, first=0, after=None):
    """Every training step of the recipe from ``first`` on (the same shuffled batches whichever step a run starts
    at), ``after(step)`` called after each."""
    inputs, labels, training, _, manager, mod_ops, _, train_op = built
    rng = np.random.default_rng(0)
    for epoch in range(manager.max_epochs):
        order = rng.permutation(len(x_train))
        for b in range(spe):
            if epoch * spe + b >= first:
                index = order[b * BATCH:(b + 1) * BATCH]
                sess.run(train_op, {inputs: x_train[index], labels: y_train[index], training: True})
                sess.run(mod_ops)
                if after is not None:
                    after(epoch * spe + b + 1)


def test_learned_scales_train_export_and_resume_in_the_graph_api(tmp_path):
    """``observer: lsq`` in the graph API: the kernels' and the layer inputs' scales are trainable variables the
    optimizer built after ``create_ops`` trains; the scales QAT uses stop moving at
    ``disable_quantization_observer_epoch``; the export converts to int8 (7-bit weights, every conv and the dense
    integer) that classifies as TensorFlow does; a run resumed from a ``Saver`` checkpoint taken during QAT ends on
    the uninterrupted run's variables, bit for bit."""
    x_train, y_train, x_test, _ = _digits()
    spe = math.ceil(len(x_train) / BATCH)
    middle, start, frozen = int(2.5 * spe), 2 * spe, 4 * spe
    with tf_compat.Graph().as_default():
        tf_compat.set_random_seed(0)
        built = _build(LSQ, spe)
        learned = [v for v in tf_compat.trainable_variables() if v.op.name.endswith("log_ratio")]
        assert len(learned) == 6  # 4 kernels, the image and the pooled features' inputs
        used = [v for v in tf_compat.global_variables() if v.op.name.endswith(("weight_scales/current", "input/max"))]
        saver, sess = tf_compat.train.Saver(), tf_compat.Session()
        sess.run(tf_compat.global_variables_initializer())
        built[4].initialize_session(sess)
        ratios, scales = {}, {}

        def read(step):
            ratios[step], scales[step] = sess.run(learned), sess.run(used)
            if step == middle:
                ratios["checkpoint"] = saver.save(sess, str(tmp_path / "ckpt"))

        _steps(sess, built, x_train, y_train, spe, after=read)
        whole = {v.op.name: sess.run(v) for v in tf_compat.global_variables()}
        built[4].complete_graph(sess=sess)
        tf_logits = sess.run(built[3], {built[0]: x_test})
        path = export_onnx(sess, tmp_path / "lsq.onnx", ["inputs:0"], ["digits_net/logits:0"])
        sess.close()
    assert not any(np.any(r) for step in range(1, start + 1) for r in ratios[step])  # QAT off: nothing learned
    assert all(np.abs(r).max() > 0 for r in ratios[frozen])  # every scale trained
    assert all(not np.array_equal(a, b) for a, b in zip(scales[start + 1], scales[frozen]))  # they moved...
    assert all(np.array_equal(a, b) for a, b in zip(scales[frozen + 1], scales[max(scales)]))  # ...then stopped
    result = quantize_qat_export(path, tmp_path / "int8.onnx")
    assert not result.unconverted and result.verification.problem(None) is None
    int8 = ort.InferenceSession(str(tmp_path / "int8.onnx")).run(None, {"inputs:0": x_test.astype(np.float32)})[0]
    assert (int8.argmax(1) == tf_logits.argmax(1)).mean() >= 0.99

    with tf_compat.Graph().as_default():  # resumed from the checkpoint taken halfway through epoch 2
        tf_compat.set_random_seed(0)
        built = _build(LSQ, spe)
        with tf_compat.Session() as sess:
            sess.run(tf_compat.global_variables_initializer())
            built[4].initialize_session(sess)
            tf_compat.train.Saver().restore(sess, ratios["checkpoint"])
            _steps(sess, built, x_train, y_train, spe, first=middle)
            resumed = {v.op.name: sess.run(v) for v in tf_compat.global_variables()}
    for name, value in whole.items():
        assert np.array_equal(resumed[name], value), name
