"""TensorFlow backend: the seed's API on tf.compat.v1 graphs."""

import os
import sys
import warnings

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")

from recal_core import RecipeError  # noqa: E402
from recal_core.schedules import pruned_count  # noqa: E402
from recal_tf import (EXTRAS_KEY_LEARNING_RATE, EXTRAS_KEY_SUMMARIES, EXTRAS_KEY_VAR_LIST,  # noqa: E402
                      EXTRAS_KEY_WEIGHT_DECAY, EXTRAS_KEY_WEIGHT_DECAY_RATE, RecalWarning, ScheduledModifierManager)
from recal_tf.models import mnist_net  # noqa: E402
from recal_tf.utils import batch_cross_entropy_loss, tf_compat  # noqa: E402

from tests.support.paths import ROOT  # noqa: E402
from tests.support.forked import run_program  # noqa: E402

SPE = 3
KERNELS = ["mnist_net/blocks/conv0/conv/weight", "mnist_net/blocks/conv1/conv/weight", "mnist_net/dense/fc/weight"]
PRUNE = """
- !EpochRangeModifier {start_epoch: 0, end_epoch: 4}
- !GradualKSModifier {params: __ALL__, init_sparsity: 0.1, final_sparsity: 0.8, start_epoch: 0.34,
                      end_epoch: 3, update_frequency: 0.34}
"""


def _data(n=8, batch=16, seed=0):
    rng = np.random.default_rng(seed)
    return [(rng.random((batch, 28, 28, 1), dtype=np.float32), np.eye(10, dtype=np.float32)[rng.integers(0, 10, batch)])
            for _ in range(n)]


class Graph:
    """mnist_net + loss + an optimizer built around a recipe, as in the seed example."""

    def __init__(self, recipe, optimizer="adam", use_lr=True, wd=False, base_lr=None):
        self.graph = tf_compat.Graph()
        with self.graph.as_default():
            tf_compat.set_random_seed(0)
            self.inputs = tf_compat.placeholder(tf.float32, [None, 28, 28, 1], name="inputs")
            self.labels = tf_compat.placeholder(tf.float32, [None, 10])
            self.logits = mnist_net(self.inputs)
            loss = batch_cross_entropy_loss(self.logits, self.labels)
            self.global_step = tf_compat.train.get_or_create_global_step()
            self.manager = ScheduledModifierManager.from_yaml(recipe)
            self.ops, self.extras = self.manager.create_ops(steps_per_epoch=SPE, base_lr=base_lr)
            lr = self.extras.get(EXTRAS_KEY_LEARNING_RATE, 1e-3) if use_lr else 1e-3
            if wd:
                loss = loss + self.extras[EXTRAS_KEY_WEIGHT_DECAY]
            opt = (tf_compat.train.AdamOptimizer(lr) if optimizer == "adam"
                   else tf_compat.train.MomentumOptimizer(lr, 0.9))
            self.train_op = opt.minimize(loss, global_step=self.global_step, var_list=tf_compat.trainable_variables())
            self.init = tf_compat.global_variables_initializer()
            self.saver = tf_compat.train.Saver()
            self.variables = {v.op.name: v for v in tf_compat.global_variables()}

    def session(self):
        return tf_compat.Session(graph=self.graph)

    def step(self, sess, batch):
        x, y = batch
        sess.run(self.train_op, {self.inputs: x, self.labels: y})
        sess.run(self.ops)


@pytest.mark.parametrize("optimizer", ["adam", "momentum"])
def test_exact_per_layer_sparsity_after_every_step(optimizer):
    g = Graph(PRUNE, optimizer)
    schedule = g.manager.schedule
    with g.session() as sess:
        sess.run(g.init)
        for k, batch in enumerate(_data(schedule.total_steps + 1), start=1):
            g.step(sess, batch)
            target = schedule.pruning[0].sparsity(k)
            for name in KERNELS:
                w = sess.run(g.variables[name])
                expected = 0 if target is None else pruned_count(target, w.size)
                assert int((w == 0).sum()) == expected, (k, name)
        assert sess.run(g.global_step) == schedule.total_steps + 1


def test_masks_in_force_before_first_forward_with_initialize_session():
    recipe = PRUNE.replace("start_epoch: 0.34,", "start_epoch: 0,")
    g = Graph(recipe)
    with g.session() as sess:
        sess.run(g.init)
        g.manager.initialize_session(sess)
        w = sess.run(g.variables[KERNELS[2]])
        assert int((w == 0).sum()) == pruned_count(0.1, w.size)


def test_initialize_session_only_initializes_recal_variables():
    g = Graph(PRUNE)
    with g.session() as sess:
        model_vars = [v for n, v in g.variables.items() if not n.startswith("recal")]
        sess.run(tf_compat.variables_initializer(model_vars))
        g.manager.initialize_session(sess)
        assert sess.run(tf_compat.report_uninitialized_variables()).size == 0
        g.step(sess, _data(1)[0])


def test_learning_rate_and_weight_decay_tensors_follow_the_core():
    recipe = """
- !EpochRangeModifier {start_epoch: 0, end_epoch: 4}
- !SetLearningRateModifier {start_epoch: 0, learning_rate: 0.01}
- !LearningRateModifier {start_epoch: 1, end_epoch: 3, lr_class: StepLR, lr_kwargs: {gamma: 0.5, step: 1}, init_lr: 0.02}
- !SetWeightDecayModifier {start_epoch: 2, weight_decay: 0.001}
"""
    g = Graph(recipe, wd=True)
    schedule = g.manager.schedule
    with g.session() as sess:
        sess.run(g.init)
        for k in range(schedule.total_steps + 1):
            lr, wd = sess.run([g.extras[EXTRAS_KEY_LEARNING_RATE], g.extras[EXTRAS_KEY_WEIGHT_DECAY_RATE]])
            assert lr == pytest.approx(schedule.lr(k)), k
            assert wd == pytest.approx(schedule.weight_decay(k) or 0.0), k
            g.step(sess, _data(1, seed=k)[0])
        assert sess.run(g.extras[EXTRAS_KEY_WEIGHT_DECAY]) > 0


def test_unused_learning_rate_warns():
    recipe = "- !SetLearningRateModifier {start_epoch: 0, learning_rate: 0.01}"
    g = Graph(recipe, use_lr=False)
    with g.session() as sess:
        sess.run(g.init)
        with pytest.warns(RecalWarning, match="EXTRAS_KEY_LEARNING_RATE"):
            g.manager.initialize_session(sess)
    used = Graph(recipe)
    with used.session() as sess, warnings.catch_warnings():
        warnings.simplefilter("error")
        sess.run(used.init)
        used.manager.initialize_session(sess)


def test_trainable_params_modifier_changes_the_collection_and_complete_graph_restores_it():
    recipe = "- !TrainableParamsModifier {params: ['re:.*/conv'], trainable: false}"
    g = Graph(recipe)
    names = [v.op.name for v in g.extras[EXTRAS_KEY_VAR_LIST]]
    assert names == ["mnist_net/dense/fc/weight", "mnist_net/dense/fc/bias"]
    with g.session() as sess:
        sess.run(g.init)
        before = sess.run(g.variables[KERNELS[0]])
        g.step(sess, _data(1)[0])
        assert np.array_equal(before, sess.run(g.variables[KERNELS[0]]))
        with g.graph.as_default():
            g.manager.complete_graph(sess=sess)
            assert len(tf_compat.trainable_variables()) == 6


def test_leave_enabled_false_and_constant_ks():
    recipe = PRUNE.replace("update_frequency: 0.34}", "update_frequency: 0.34, leave_enabled: false}")
    g = Graph(recipe)
    end = g.manager.schedule.pruning[0].span.end
    with g.session() as sess:
        sess.run(g.init)
        data = _data(end + 3)
        for k in range(end):
            g.step(sess, data[k])
        w = sess.run(g.variables[KERNELS[2]])
        assert int((w == 0).sum()) == pruned_count(0.8, w.size)
        g.step(sess, data[end])
        g.step(sess, data[end + 1])
        assert int((sess.run(g.variables[KERNELS[2]]) == 0).sum()) < pruned_count(0.8, w.size)

    g = Graph("- !ConstantKSModifier {params: ['mnist_net/dense/fc']}\n"
              "- !EpochRangeModifier {start_epoch: 0, end_epoch: 2}")
    with g.session() as sess:
        sess.run(g.init)
        fc = g.variables[KERNELS[2]]
        sess.run(fc.assign(tf.where(tf.abs(fc) < 0.02, tf.zeros_like(fc), fc)))
        zeros = sess.run(fc) == 0
        g.manager.initialize_session(sess)  # captures the zeros before the first optimizer step
        for batch in _data(5):
            g.step(sess, batch)
        assert np.array_equal(sess.run(fc) == 0, zeros) and zeros.sum() > 0


def test_resume_from_saver_checkpoint_continues_exactly(tmp_path):
    data = _data(12)
    total = 10
    a = Graph(PRUNE)
    with a.session() as sess:
        sess.run(a.init)
        for k in range(total):
            a.step(sess, data[k])
        final_a = {n: sess.run(v) for n, v in a.variables.items()}
    b = Graph(PRUNE)
    with b.session() as sess:
        sess.run(b.init)
        for k in range(5):
            b.step(sess, data[k])
        path = b.saver.save(sess, str(tmp_path / "ckpt"), global_step=b.global_step)
    c = Graph(PRUNE)
    with c.session() as sess:
        c.saver.restore(sess, path)
        c.manager.initialize_session(sess)  # keeps the restored masks
        assert sess.run(c.global_step) == 5
        for k in range(5, total):
            c.step(sess, data[k])
        final_c = {n: sess.run(v) for n, v in c.variables.items()}
    for name, value in final_a.items():
        if name.startswith("recal/"):
            assert np.array_equal(value, final_c[name]), name
        else:
            np.testing.assert_allclose(value, final_c[name], rtol=1e-5, atol=1e-6, err_msg=name)
    for name in KERNELS:
        assert np.array_equal(final_a[name] == 0, final_c[name] == 0)


def test_complete_graph_then_saver_and_frozen_inference(tmp_path):
    g = Graph(PRUNE)
    with g.session() as sess:
        sess.run(g.init)
        for k, batch in enumerate(_data(g.manager.schedule.total_steps)):
            g.step(sess, batch)
        x = _data(1, batch=32, seed=9)[0][0]
        expected = sess.run(g.logits, {g.inputs: x})
        with g.graph.as_default():
            sparsity = g.manager.complete_graph(sess=sess)
            assert sparsity == {name: pruned_count(0.8, int(np.prod(g.variables[name].shape))) /
                                int(np.prod(g.variables[name].shape)) for name in KERNELS}
            saver = tf_compat.train.Saver()
            saved = {v.op.name for v in tf_compat.global_variables()}
            assert not any(n.startswith("recal/") for n in saved)
            path = saver.save(sess, str(tmp_path / "model"))
            frozen = tf_compat.graph_util.convert_variables_to_constants(
                sess, g.graph.as_graph_def(), ["mnist_net/logits"])
    assert not [n.name for n in frozen.node if n.name.startswith("recal")]
    reader = tf.train.load_checkpoint(path)
    assert not [k for k in reader.get_variable_to_shape_map() if k.startswith("recal")]
    w = reader.get_tensor(KERNELS[2])
    assert int((w == 0).sum()) == pruned_count(0.8, w.size)
    with tf_compat.Graph().as_default() as inference, tf_compat.Session(graph=inference) as sess:
        tf_compat.import_graph_def(frozen, name="")
        got = sess.run("mnist_net/logits:0", {"inputs:0": x})
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)


def test_summaries_created_and_collected():
    g = Graph(PRUNE.replace("- !EpochRangeModifier", "- !SetLearningRateModifier {learning_rate: 0.01}\n"
                                                     "- !EpochRangeModifier"))
    summaries = g.extras[EXTRAS_KEY_SUMMARIES]
    names = [s.op.name for s in summaries]
    assert len(summaries) == 4 and any("Modifier_LR" in n for n in names)
    with g.graph.as_default():
        assert all(s in tf_compat.get_collection(tf_compat.GraphKeys.SUMMARIES) for s in summaries)


def _model_with_ops(recipe):
    """Inside a new default graph: mnist_net, its loss, the global step, and recal's ops for ``recipe``
    (for tests that build their own optimizer)."""
    inputs = tf_compat.placeholder(tf.float32, [None, 28, 28, 1])
    labels = tf_compat.placeholder(tf.float32, [None, 10])
    loss = batch_cross_entropy_loss(mnist_net(inputs), labels)
    global_step = tf_compat.train.get_or_create_global_step()
    manager = ScheduledModifierManager.from_yaml(recipe)
    manager.create_ops(steps_per_epoch=SPE)
    fc = [v for v in tf_compat.global_variables() if v.op.name == KERNELS[2]][0]
    return inputs, labels, loss, global_step, manager, fc


def test_session_run_hook_with_monitored_training_session():
    with tf_compat.Graph().as_default():
        inputs, labels, loss, global_step, manager, fc = _model_with_ops(PRUNE)
        train_op = tf_compat.train.AdamOptimizer(1e-3).minimize(loss, global_step=global_step)
        with tf_compat.train.MonitoredTrainingSession(hooks=[manager.session_run_hook()]) as sess:
            for x, y in _data(SPE * 3):
                sess.run(train_op, {inputs: x, labels: y})
            w = sess.run(fc)
    target = manager.schedule.pruning[0].sparsity(SPE * 3)
    assert int((w == 0).sum()) == pruned_count(target, w.size)


@pytest.mark.parametrize("recipe, words", [
    ("- !QuantizationModifier {start_epoch: 0, ignore: [fc]}", "ignore is not available in the TensorFlow graph API"),
    ("- !QuantizationModifier {start_epoch: 0}\n- !QuantizationModifier {start_epoch: 1}",
     "a second QuantizationModifier"),
    ("- !TrainableParamsModifier {params: __ALL__, trainable: false, start_epoch: 1, end_epoch: 2}",
     "TensorFlow fixes the trainable variables"),
    ("- !GradualKSModifier {params: ['re:.*/convx'], init_sparsity: 0.1, final_sparsity: 0.5, start_epoch: 0, "
     "end_epoch: 2, update_frequency: 1}", "matches no prunable parameter; closest:"),
    ("- !ConstantKSModifier {params: ['mnist_net/dense/fc/bias']}", "selects no conv/dense kernel"),
    ("- !LearningRateModifier {start_epoch: 0, end_epoch: 2, lr_class: ExponentialLR, lr_kwargs: {gamma: 0.9}}",
     "field 'init_lr'"),
    ("- !SetLearningRateModifier {start_epoch: 1, learning_rate: 0.1}", "before the first LR modifier starts"),
    ("- !MFACPruningModifier {params: __ALL_PRUNABLE__, init_sparsity: 0.1, final_sparsity: 0.5, start_epoch: 0, "
     "end_epoch: 2, update_frequency: 1}", "second-order pruning (MFACPruningModifier) is not available"),
])
def test_create_ops_errors(recipe, words):
    with pytest.raises(RecipeError, match=f"<string>:{recipe.count(chr(10)) + 1}:") as err:
        Graph(recipe)
    assert words in str(err.value)


def test_base_lr_fills_the_lr_before_the_first_modifier():
    g = Graph("- !SetLearningRateModifier {start_epoch: 1, learning_rate: 0.1}", base_lr=0.5)
    with g.session() as sess:
        sess.run(g.init)
        assert sess.run(g.extras[EXTRAS_KEY_LEARNING_RATE]) == pytest.approx(0.5)


def test_create_ops_lifecycle_errors():
    g = Graph(PRUNE)
    with g.graph.as_default():
        with pytest.raises(RuntimeError, match="already called"):
            ScheduledModifierManager.from_yaml(PRUNE).create_ops(steps_per_epoch=SPE)
        with tf_compat.Session() as sess, sess.as_default():
            with pytest.raises(RuntimeError, match="outside any session"):
                ScheduledModifierManager.from_yaml(PRUNE).create_ops(steps_per_epoch=SPE)
    with pytest.raises(RuntimeError, match="create_ops"):
        ScheduledModifierManager.from_yaml(PRUNE).initialize_session()


def test_cross_framework_parity_of_targets_and_lr():
    torch = pytest.importorskip("torch")
    from recal_torch import ScheduledModifierManager as TorchManager

    recipe = PRUNE + "- !LearningRateModifier {start_epoch: 0, end_epoch: 4, lr_class: ExponentialLR, " \
                     "lr_kwargs: {gamma: 0.7}, init_lr: 0.01}\n"
    g = Graph(recipe, optimizer="momentum")
    shapes = {name: g.variables[name].shape.as_list() for name in KERNELS}
    model = torch.nn.Sequential(torch.nn.Linear(shapes[KERNELS[2]][0], shapes[KERNELS[2]][1]))
    tm = TorchManager.from_yaml(recipe)
    opt = tm.modify(model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9), steps_per_epoch=SPE)
    data = _data(g.manager.schedule.total_steps)
    with g.session() as sess:
        sess.run(g.init)
        for k, batch in enumerate(data, start=1):
            g.step(sess, batch)
            opt.zero_grad()
            model(torch.randn(4, shapes[KERNELS[2]][0])).sum().backward()
            opt.step()
            tf_zeros = int((sess.run(g.variables[KERNELS[2]]) == 0).sum())
            torch_zeros = int((model[0].weight == 0).sum())
            assert tf_zeros == torch_zeros, k
            assert sess.run(g.extras[EXTRAS_KEY_LEARNING_RATE]) == pytest.approx(opt.param_groups[0]["lr"]), k


@pytest.mark.slow
def test_seed_example_runs_as_written(tmp_path):
    """The seed's example file, unchanged, on the seed's recipe with its epochs scaled 25 -> 10 (pruning 5-20 ->
    2-8, still once per epoch): 160 steps at batch 1024 instead of 400, the same code path. The recipe as
    written, the example's default, is run step by step in the next test."""
    seed = (ROOT / "recal_core" / "recipes" / "seed_prune_all.yaml").read_text()
    scaled = seed.replace("end_epoch: 25.0", "end_epoch: 10.0").replace("start_epoch: 5.0", "start_epoch: 2.0")
    scaled = scaled.replace("end_epoch: 20.0", "end_epoch: 8.0")
    assert scaled.count("epoch: 10.0") + scaled.count("epoch: 2.0") + scaled.count("epoch: 8.0") == 3
    (tmp_path / "seed_scaled.yaml").write_text(scaled)
    out = run_program(str(ROOT / "scripts" / "examples" / "seed_tf.py"), str(tmp_path / "seed_scaled.yaml"), cwd=ROOT,
                      timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = dict(line.rsplit(" ", 1) for line in out.stdout.splitlines() if line.startswith(("test", "sparsity")))
    print(out.stdout)
    assert float(lines["test accuracy"]) > 0.6  # chance is 0.1
    for name in KERNELS:
        assert float(lines[f"sparsity {name}"]) == pytest.approx(0.8, abs=1e-4)


def test_the_seed_recipe_as_written_prunes_the_seed_net_exactly_at_every_step(seed_recipe_text):
    """The seed's config.yaml in full (25 epochs, pruning 5 -> 20 once per epoch) on the seed example's net and
    API, with small batches: every kernel holds the schedule's count of zeros after every step, 80% at the end."""
    g = Graph(seed_recipe_text)
    schedule = g.manager.schedule
    assert schedule.total_steps == 25 * SPE
    with g.session() as sess:
        sess.run(g.init)
        for k, batch in enumerate(_data(schedule.total_steps, batch=4), start=1):
            g.step(sess, batch)
            target = schedule.pruning[0].sparsity(k)
            for name in KERNELS:
                w = sess.run(g.variables[name])
                assert int((w == 0).sum()) == (0 if target is None else pruned_count(target, w.size)), (k, name)
        assert g.manager.complete_graph() == pytest.approx({name: 0.8 for name in KERNELS}, abs=1e-4)


def test_train_op_with_ops_is_one_call_per_step():
    g = Graph(PRUNE)
    with g.graph.as_default():
        fused = g.manager.train_op_with_ops(g.train_op)
    schedule = g.manager.schedule
    with g.session() as sess:
        sess.run(g.init)
        for k, (x, y) in enumerate(_data(schedule.total_steps), start=1):
            sess.run(fused, {g.inputs: x, g.labels: y})
            target = schedule.pruning[0].sparsity(k)
            w = sess.run(g.variables[KERNELS[1]])
            assert int((w == 0).sum()) == (0 if target is None else pruned_count(target, w.size)), k


def test_pruned_weights_are_never_ranked_back_in():
    g = Graph(PRUNE, "momentum")  # the seed's API: no gradient masking, momentum moves pruned weights
    with g.session() as sess:
        sess.run(g.init)
        previous = None
        for batch in _data(g.manager.schedule.total_steps):
            g.step(sess, batch)
            zeros = sess.run(g.variables[KERNELS[2]]) == 0
            if previous is not None:
                assert np.all(zeros[previous]), "a pruned weight came back"
            previous = zeros


def test_mask_gradients_keeps_pruned_weights_out_of_the_optimizer():
    with tf_compat.Graph().as_default():
        inputs, labels, loss, step, manager, fc = _model_with_ops(PRUNE)
        opt = tf_compat.train.MomentumOptimizer(0.1, 0.9)
        train = manager.train_op_with_ops(opt.apply_gradients(manager.mask_gradients(opt.compute_gradients(loss)),
                                                              global_step=step))
        slot = opt.get_slot(fc, "momentum")
        with tf_compat.Session() as sess:
            sess.run(tf_compat.global_variables_initializer())
            data = _data(SPE * 2 + 1)
            for x, y in data[:-1]:
                sess.run(train, {inputs: x, labels: y})
            w, before = sess.run([fc, slot])
            sess.run(train, {inputs: data[-1][0], labels: data[-1][1]})
            after = sess.run(slot)
    pruned = w == 0
    # a pruned weight's gradient is masked: its momentum only decays (v <- 0.9 v + 0)
    assert pruned.sum() > 0
    np.testing.assert_allclose(after[pruned], 0.9 * before[pruned], rtol=1e-5, atol=1e-12)


def test_ties_broken_by_position_as_in_torch():
    recipe = PRUNE.replace("start_epoch: 0.34,", "start_epoch: 0,")
    g = Graph(recipe)
    with g.session() as sess:
        sess.run(g.init)
        fc = g.variables[KERNELS[2]]
        sess.run(fc.assign(tf.ones_like(fc)))
        g.manager.initialize_session(sess)
        flat = sess.run(fc).reshape(-1)
    count = pruned_count(0.1, flat.size)
    assert np.all(flat[:count] == 0) and np.all(flat[count:] == 1)


def test_a_custom_global_step_drives_every_op():
    with tf_compat.Graph().as_default():
        inputs = tf_compat.placeholder(tf.float32, [None, 28, 28, 1])
        labels = tf_compat.placeholder(tf.float32, [None, 10])
        loss = batch_cross_entropy_loss(mnist_net(inputs), labels)
        my_step = tf_compat.get_variable("my_step", [], tf.int64, tf_compat.zeros_initializer(), trainable=False)
        manager = ScheduledModifierManager.from_yaml(PRUNE)
        manager.create_ops(steps_per_epoch=SPE, global_step=my_step)
        opt = tf_compat.train.MomentumOptimizer(0.1, 0.9)
        train = manager.train_op_with_ops(opt.apply_gradients(manager.mask_gradients(opt.compute_gradients(loss)),
                                                              global_step=my_step))
        assert tf_compat.train.get_global_step() is None  # recal did not create another step
        fc = [v for v in tf_compat.global_variables() if v.op.name == KERNELS[2]][0]
        with tf_compat.Session() as sess:
            sess.run(tf_compat.global_variables_initializer())
            for k, (x, y) in enumerate(_data(SPE * 2), start=1):
                sess.run(train, {inputs: x, labels: y})
                target = manager.schedule.pruning[0].sparsity(k)
                w = sess.run(fc)
                assert int((w == 0).sum()) == (0 if target is None else pruned_count(target, w.size)), k


def test_importing_the_tf_front_ends_prints_no_tensorflow_start_up_lines():
    """TensorFlow's absl lines (``oneDNN custom operations are on``) print on import whatever TF_CPP_MIN_LOG_LEVEL
    says; importing recal_tf's front ends drops them, in a fresh interpreter (not forked: TensorFlow must import)."""
    import subprocess

    code = "import recal_keras, recal_tf.graph, recal_tf.models"
    env = {k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"}
    bare = subprocess.run([sys.executable, "-c", "import tensorflow"], capture_output=True, text=True, env=env)
    ours = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    if "oneDNN" not in bare.stderr:
        pytest.skip("this TensorFlow build prints no start-up lines")
    assert "oneDNN" not in ours.stderr and "absl::InitializeLog" not in ours.stderr, ours.stderr


def test_a_real_message_during_a_quiet_import_still_shows(tmp_path, monkeypatch, capfd):
    from recal_keras.quiet_start import import_quietly

    (tmp_path / "noisy_module.py").write_text(
        "import os\nos.write(2, b'WARNING: All log messages before absl::InitializeLog() is called are written to "
        "STDERR\\n')\nos.write(2, b'I0000 00:00:1795899846.289855   24267 port.cc:153] oneDNN custom operations "
        "are on.\\n')\nos.write(2, b'E0000 something the user must see\\n')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "tensorflow")  # as if TensorFlow were not imported yet
    import_quietly("noisy_module")
    err = capfd.readouterr().err
    assert "something the user must see" in err and "oneDNN" not in err and "absl" not in err


def test_the_old_name_of_keras_support_is_the_new_package():
    """``recal_tf.keras`` was Keras support's home before ``recal_keras``: code written against it keeps working."""
    import recal_keras
    import recal_tf.keras
    from recal_tf.keras import ScheduledModifierManager as Old

    assert recal_tf.keras is recal_keras and Old is recal_keras.ScheduledModifierManager
