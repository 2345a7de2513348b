"""Structured masks (filter, channel, [a, b] blocks, N:M): one core layout, the same masks in every backend."""

import numpy as np
import pytest
import torch

from recal_core import RecipeError, load_recipe
from recal_core.mask_layout import mask_layout, mask_numpy
from recal_torch import ScheduledModifierManager

from tests.support.torch_models import SmallCNN, batches, train_steps

SPE = 4


def _recipe(mask_type, final=0.5, params="__ALL_PRUNABLE__"):
    return (f"- !GradualKSModifier {{params: {params}, init_sparsity: 0.125, final_sparsity: {final}, "
            f"start_epoch: 0, end_epoch: 3, update_frequency: 0.5, mask_type: {mask_type}}}\n"
            "- !EpochRangeModifier {start_epoch: 0, end_epoch: 4}")


@pytest.mark.parametrize("mask_type, params", [
    ("filter", "[conv1, conv2, conv3]"), ("channel", "[conv2, conv3, fc]"), ("[2, 4]", "[conv2, conv3, fc]"),
    ("'2:4'", "[conv2, conv3, fc]"), ("block4", "[conv2, conv3, fc]"),
])
def test_torch_structured_masks_are_exact_after_every_step(mask_type, params):
    torch.manual_seed(0)
    model = SmallCNN()
    manager = ScheduledModifierManager.from_yaml(_recipe(mask_type, params=params))
    optimizer = manager.modify(model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), steps_per_epoch=SPE)
    plan, ps = manager.plan, manager.schedule.pruning[0]
    weights = {n: p for n, p in model.named_parameters() if n in plan.masks}
    seen = set()

    def check(k):
        for name, w in weights.items():
            mask_plan = plan.masks[name]
            expected = mask_plan.zeros(ps, k)
            assert int((w == 0).sum()) == expected, (k, name)
            layout = mask_plan.layouts[ps.index]
            # the zeros form whole groups: the mask of the current weights' own ranking reproduces them
            view = w.detach().permute(*layout.perm).reshape(layout.rows, layout.cols).numpy()
            if layout.n_of_m is not None:
                assert ((view.reshape(-1, layout.n_of_m[1]) != 0).sum(1) >= layout.n_of_m[0]).all()
            elif layout.mask_type == "filter":
                rows = (view == 0).all(axis=1)
                assert rows.sum() * layout.group_size == expected
            seen.add(expected)

    check(0)
    train_steps(model, optimizer, batches(manager.max_epochs * SPE), after_step=check)
    assert len(seen) >= 3


def test_the_core_reference_and_torch_agree_on_ties():
    from recal_torch.pruning import structured_mask

    rng = np.random.default_rng(0)
    for mask_type, shape in [("filter", (8, 4, 3, 3)), ("channel", (8, 4, 3, 3)), ((1, 4), (8, 8, 3, 3)),
                             ((2, 2), (8, 8)), ("2:4", (8, 8, 3, 3)), ("1:4", (6, 12))]:
        w = np.round(rng.standard_normal(shape), 1).astype(np.float32)  # many ties
        layout = mask_layout(mask_type, shape)
        for sparsity in (0.25, 0.5, 0.75):
            count = layout.count(sparsity)
            ours = structured_mask(torch.from_numpy(w), layout, count, tuple(range(len(shape)))).numpy()
            assert np.array_equal(ours, mask_numpy(w, layout, count)), (mask_type, sparsity)
            assert (ours == 0).sum() == layout.zeros_at(sparsity)


def test_tf_graph_structured_masks_equal_the_core_reference():
    import tensorflow as tf

    from recal_tf import ScheduledModifierManager as TFManager
    from recal_tf.utils import tf_compat

    rng = np.random.default_rng(1)  # continuous weights: group scores summed in another order still rank alike
    kernel = rng.standard_normal((3, 3, 8, 16)).astype(np.float32)  # HWIO
    dense = rng.standard_normal((16, 8)).astype(np.float32)  # [in, out]
    for mask_type in ("filter", "channel", "[2, 4]", "'2:4'"):
        params = "[conv]" if mask_type == "filter" else "[conv, fc]"  # fc's filters are the logits
        with tf_compat.Graph().as_default():
            x = tf_compat.placeholder(tf.float32, [None, 6, 6, 8])
            first = tf_compat.get_variable("first/weight", initializer=np.eye(8, dtype=np.float32)[None, None],
                                           use_resource=True)  # a layer before: conv's input channels can drop
            w = tf_compat.get_variable("conv/weight", initializer=kernel, use_resource=True)
            d = tf_compat.get_variable("fc/weight", initializer=dense, use_resource=True)
            y = tf.nn.relu(tf.nn.conv2d(tf.nn.conv2d(x, first, 1, "SAME"), w, 1, "SAME"))
            tf.matmul(tf.reduce_mean(y, axis=[1, 2]), d)
            tf_compat.train.get_or_create_global_step()
            manager = TFManager.from_yaml(_recipe(mask_type, final=0.5, params=params))
            ops, _ = manager.create_ops(steps_per_epoch=SPE)
            with tf_compat.Session() as sess:
                sess.run(tf_compat.global_variables_initializer())
                manager.initialize_session(sess)
                got_w, got_d = sess.run([w, d])
        count = manager.schedule.pruning[0].sparsity(0)
        pairs = ((got_w, kernel, (3, 2, 0, 1)), (got_d, dense, (1, 0)))[: 1 if mask_type == "filter" else 2]
        for got, original, axes in pairs:
            canonical = np.transpose(original, axes)
            layout = mask_layout(load_recipe(_recipe(mask_type)).modifiers[0].mask_type, canonical.shape)
            expected = canonical * mask_numpy(canonical, layout, layout.count(count))
            assert np.array_equal(np.transpose(got, axes), expected), mask_type


@pytest.mark.parametrize("recipe, words", [
    (_recipe("'2:4'", final=0.6), "keeps at most 0.5 of the weights; final_sparsity 0.6 is beyond its 0.5"),
    (_recipe("'3:2'"), "N:M needs 1 <= N <= M"),
    (_recipe("[1, 3]", params="[conv2]"), "block [1, 3] does not divide the layer's [8 out, 8 in] channels"),
    (_recipe("'2:3'", final=0.3, params="[conv2]"), "needs input channels in runs of 3; the layer has 8"),
    (_recipe("diagonal"), "is not one recal knows"),
])
def test_a_mask_type_a_layer_cannot_take_is_a_located_error(recipe, words):
    with pytest.raises(RecipeError) as err:
        model = SmallCNN()
        ScheduledModifierManager.from_yaml(recipe).modify(model, torch.optim.SGD(model.parameters(), lr=0.1), SPE)
    assert words in str(err.value) and "<string>:1:" in str(err.value) and "field 'mask_type'" in str(err.value)


GLOBAL = """
- !GlobalMagnitudePruningModifier {params: __ALL_PRUNABLE__, init_sparsity: 0.2, final_sparsity: 0.8,
                                   start_epoch: 0, end_epoch: 2, update_frequency: 0.5}
- !EpochRangeModifier {start_epoch: 0, end_epoch: 3}
"""


@pytest.mark.parametrize("recipe", [GLOBAL, GLOBAL.replace("!GlobalMagnitudePruningModifier",
                                                           "!GMPruningModifier").replace("0.5}", "0.5, global_sparsity: true}")])
def test_torch_global_magnitude_is_one_ranking_with_an_exact_total(recipe):
    torch.manual_seed(0)
    model = SmallCNN()
    manager = ScheduledModifierManager.from_yaml(recipe)
    optimizer = manager.modify(model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), steps_per_epoch=SPE)
    kernels = {n: p for n, p in model.named_parameters() if n in manager.plan.masks}

    def check(k):
        zeros = sum(int((p == 0).sum()) for p in kernels.values())
        assert zeros == manager.plan.global_zeros(0, k), k

    check(0)
    train_steps(model, optimizer, batches(3 * SPE), after_step=check)
    sparsities = [float((p == 0).float().mean()) for p in kernels.values()]
    assert max(sparsities) - min(sparsities) > 0.2  # layers end at different sparsities


def test_tf_global_magnitude_equals_torch_on_the_same_weights():
    import tensorflow as tf

    from recal_tf import ScheduledModifierManager as TFManager
    from recal_tf.utils import tf_compat

    rng = np.random.default_rng(2)
    conv = rng.standard_normal((8, 4, 3, 3)).astype(np.float32)  # OIHW
    fc = rng.standard_normal((10, 32)).astype(np.float32)  # [out, in]
    with tf_compat.Graph().as_default():
        x = tf_compat.placeholder(tf.float32, [None, 4, 4, 4])
        w = tf_compat.get_variable("conv/weight", initializer=np.transpose(conv, (2, 3, 1, 0)), use_resource=True)
        d = tf_compat.get_variable("fc/weight", initializer=fc.T.copy(), use_resource=True)
        y = tf.nn.conv2d(x, w, 1, "SAME")
        tf.matmul(tf.reshape(y[:, :2, :2, :], [-1, 32]), d)
        tf_compat.train.get_or_create_global_step()
        manager = TFManager.from_yaml(GLOBAL.replace("__ALL_PRUNABLE__", "[conv, fc]"))
        manager.create_ops(steps_per_epoch=SPE)
        with tf_compat.Session() as sess:
            sess.run(tf_compat.global_variables_initializer())
            manager.initialize_session(sess)
            got_conv, got_fc = sess.run([w, d])
    from recal_torch.pruning import joint_magnitude_masks

    count = int(np.floor(0.2 * (conv.size + fc.size) + 0.5))
    masks = joint_magnitude_masks([torch.from_numpy(conv), torch.from_numpy(fc)], count)
    assert np.array_equal(np.transpose(got_conv, (3, 2, 0, 1)), conv * masks[0].numpy())
    assert np.array_equal(got_fc.T, fc * masks[1].numpy())


def test_a_group_pruned_in_blocks_zeroes_whole_blocks_ranked_by_their_sums():
    """A weight-only reader quantized in groups of 4 inputs: channels go in whole blocks of 4, the block of least
    summed squared norm first, even when a single channel elsewhere is smaller."""
    from recal_core.model_plan import ChannelGroup
    from recal_torch.pruning.channels import group_masks

    weight = torch.ones(8, 3)
    weight[6] = 0.01  # the smallest channel, in a block whose other channels are large
    weight[0:4] *= 0.5  # the block of least summed norm
    group = ChannelGroup(0, "filter", {"w": 1}, (), 8, block=4)
    mask = group_masks(group, {"w": weight}, 4)["w"]
    assert mask[:, 0].tolist() == [0, 0, 0, 0, 1, 1, 1, 1]
