"""Filter and channel pruning in the TensorFlow graph API follow the same coupling rules as PyTorch: a
residual add's producers rank together (the same channels as recal_torch on the same weights), BatchNorm
shifts and biases are zeroed with their filters, and a layer whose channels cannot drop is an error."""

import numpy as np
import pytest
import torch
from torch import nn

from recal_core import RecipeError
from recal_torch import ScheduledModifierManager as TorchManager

tf = pytest.importorskip("tensorflow")
from recal_tf import ScheduledModifierManager  # noqa: E402
from recal_tf.utils import tf_compat  # noqa: E402

RECIPE = """
- !EpochRangeModifier {{start_epoch: 0, end_epoch: 2}}
- !GradualKSModifier {{params: {params}, init_sparsity: 0.5, final_sparsity: 0.5, start_epoch: 0, end_epoch: 1,
                      update_frequency: 1, mask_type: filter}}
"""
rng = np.random.default_rng(0)
A = rng.standard_normal((1, 1, 3, 8)).astype(np.float32)  # HWIO
B = rng.standard_normal((3, 3, 8, 8)).astype(np.float32)
BIAS = rng.standard_normal(8).astype(np.float32)
FC = rng.standard_normal((8, 4)).astype(np.float32)


def _tf_masks(params):
    with tf_compat.Graph().as_default():
        x = tf_compat.placeholder(tf.float32, [None, 6, 6, 3])
        a = tf_compat.get_variable("a/weight", initializer=A, use_resource=True)
        b = tf_compat.get_variable("b/weight", initializer=B, use_resource=True)
        bias = tf_compat.get_variable("b/bias", initializer=BIAS, use_resource=True)
        fc = tf_compat.get_variable("fc/weight", initializer=FC, use_resource=True)
        ya = tf.nn.relu(tf.nn.conv2d(x, a, 1, "SAME"))
        yb = tf.nn.bias_add(tf.nn.conv2d(ya, b, 1, "SAME"), bias)
        tf.matmul(tf.reduce_mean(tf.nn.relu(ya + yb), axis=[1, 2]), fc)
        tf_compat.train.get_or_create_global_step()
        manager = ScheduledModifierManager.from_yaml(RECIPE.format(params=params))
        manager.create_ops(steps_per_epoch=2)
        with tf_compat.Session() as sess:
            sess.run(tf_compat.global_variables_initializer())
            manager.initialize_session(sess)
            return sess.run([a, b, bias])


class Residual(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Conv2d(3, 8, 1, bias=False)
        self.b = nn.Conv2d(8, 8, 3, padding=1)
        self.fc = nn.Linear(8, 4, bias=False)
        with torch.no_grad():
            self.a.weight.copy_(torch.from_numpy(A.transpose(3, 2, 0, 1)))
            self.b.weight.copy_(torch.from_numpy(B.transpose(3, 2, 0, 1)))
            self.b.bias.copy_(torch.from_numpy(BIAS))
            self.fc.weight.copy_(torch.from_numpy(FC.T))

    def forward(self, x):
        ya = torch.relu(self.a(x))
        return self.fc(torch.relu(ya + self.b(ya)).mean((2, 3)))


def test_a_residual_add_prunes_the_same_channels_in_both_frameworks():
    a, b, bias = _tf_masks("[a/weight, b/weight]")
    pruned_a = (a == 0).reshape(-1, 8).all(0)
    pruned_b = (b == 0).reshape(-1, 8).all(0)
    assert np.array_equal(pruned_a, pruned_b) and pruned_a.sum() == 4
    assert np.all(bias[pruned_b] == 0) and np.all(bias[~pruned_b] != 0)
    model = Residual()
    TorchManager.from_yaml(RECIPE.format(params="[a, b]")).modify(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                                                  steps_per_epoch=2)
    torch_pruned = (model.a.weight == 0).flatten(1).all(1).numpy()
    assert np.array_equal(torch_pruned, pruned_a)


@pytest.mark.parametrize("params, words", [
    ("[a/weight]", "b/weight adds its output to a/weight"),
    ("[fc/weight]", "also reach the model's output"),
])
def test_a_layer_whose_channels_cannot_drop_is_a_located_error(params, words):
    with pytest.raises(RecipeError, match=r"<string>:4:\d+: .*field 'mask_type'") as err:
        _tf_masks(params)
    assert words in str(err.value), str(err.value)
