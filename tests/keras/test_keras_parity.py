"""The same recipe gives the same zeros and learning rates in PyTorch, the TensorFlow graph API and Keras."""

import numpy as np
import pytest
tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")
from recal_keras import ScheduledModifierManager  # noqa: E402
from tests.support.keras_blocks import SPE  # noqa: E402
from tests.keras.keras_models import PARITY, _data, _keras_parity_net  # noqa: E402


def test_same_recipe_same_zeros_and_lr_in_torch_tf_graph_and_keras():
    """One recipe, three backends, one model shape: after every step each layer holds the same number of
    zeros and the LR is the same (GradualKS released at its end, ConstantKS ending mid-run, StepLR)."""
    torch = pytest.importorskip("torch")
    from recal_tf import ScheduledModifierManager as GraphManager
    from recal_tf.utils import tf_compat
    from recal_torch import ScheduledModifierManager as TorchManager

    steps = 3 * SPE
    x, y = _data(SPE * 8)  # one epoch of batches of 8, fed again each epoch

    class TorchNet(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.c1, self.c2 = torch.nn.Conv2d(1, 8, 3), torch.nn.Conv2d(8, 8, 3)
            self.fc = torch.nn.Linear(8 * 4 * 4, 10)

        def forward(self, t):
            return self.fc(self.c2(self.c1(t)).flatten(1))

    torch.manual_seed(0)
    tnet = TorchNet()
    with torch.no_grad():
        tnet.c1.weight.view(-1)[:10] = 0
    tm = TorchManager.from_yaml(PARITY)
    topt = tm.modify(tnet, torch.optim.SGD(tnet.parameters(), lr=0.1, momentum=0.9), steps_per_epoch=SPE)

    graph = tf_compat.Graph()
    with graph.as_default():
        tf_compat.set_random_seed(0)
        gx = tf_compat.placeholder(tf.float32, [None, 8, 8, 1])
        gy = tf_compat.placeholder(tf.int64, [None])
        init = tf_compat.glorot_uniform_initializer()
        w1 = tf_compat.get_variable("c1/kernel", [3, 3, 1, 8], initializer=init, use_resource=True)
        w2 = tf_compat.get_variable("c2/kernel", [3, 3, 8, 8], initializer=init, use_resource=True)
        w3 = tf_compat.get_variable("fc/kernel", [128, 10], initializer=init, use_resource=True)
        h = tf.nn.conv2d(tf.nn.conv2d(gx, w1, 1, "VALID"), w2, 1, "VALID")
        logits = tf.matmul(tf.reshape(h, [-1, 128]), w3)
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=gy, logits=logits))
        step = tf_compat.train.get_or_create_global_step()
        gm = GraphManager.from_yaml(PARITY)
        ops, extras = gm.create_ops(steps_per_epoch=SPE)
        train = tf_compat.train.MomentumOptimizer(extras["learning_rate"], 0.9).minimize(loss, global_step=step)
        zero_first = tf.tensor_scatter_nd_update(tf.reshape(tf.transpose(w1, [3, 2, 0, 1]), [-1]),
                                                 tf.range(10)[:, None], tf.zeros(10))
        reset_w1 = w1.assign(tf.transpose(tf.reshape(zero_first, [8, 1, 3, 3]), [2, 3, 1, 0]))
        initializer = tf_compat.global_variables_initializer()
    sess = tf_compat.Session(graph=graph)
    sess.run(initializer)
    sess.run(reset_w1)
    gm.initialize_session(sess)

    knet = _keras_parity_net()
    k1 = knet.get_layer("c1").kernel
    flat = np.transpose(k1.numpy(), [3, 2, 0, 1]).reshape(-1)
    flat[:10] = 0
    k1.assign(np.transpose(flat.reshape(8, 1, 3, 3), [2, 3, 1, 0]))
    kopt = keras.optimizers.SGD(0.1, momentum=0.9)
    km = ScheduledModifierManager.from_yaml(PARITY)
    knet, callbacks = km.modify(knet, kopt, steps_per_epoch=SPE)
    knet.compile(optimizer=kopt, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    keras_rows = []

    class Rows(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            keras_rows.append([float(kopt.learning_rate.numpy())])

        def on_train_batch_end(self, batch, logs=None):
            keras_rows[-1].append([int((knet.get_layer(n).kernel.numpy() == 0).sum()) for n in ("c1", "c2", "fc")])

    knet.fit(x, y, batch_size=8, epochs=3, callbacks=callbacks + [Rows()], verbose=0, shuffle=False)

    nonzero_c1_seen = False
    for k in range(steps):
        b = k % SPE
        xb, yb = x[b * 8:(b + 1) * 8], y[b * 8:(b + 1) * 8]
        torch_lr = topt.param_groups[0]["lr"]
        topt.zero_grad()
        torch.nn.functional.cross_entropy(tnet(torch.from_numpy(xb).permute(0, 3, 1, 2)),
                                          torch.from_numpy(yb)).backward()
        topt.step()
        graph_lr = sess.run(extras["learning_rate"])
        sess.run(train, {gx: xb, gy: yb})
        sess.run(ops)
        torch_zeros = [int((m.weight == 0).sum()) for m in (tnet.c1, tnet.c2, tnet.fc)]
        graph_zeros = [int((sess.run(v) == 0).sum()) for v in (w1, w2, w3)]
        keras_lr, keras_zeros = keras_rows[k]
        assert torch_zeros == graph_zeros == keras_zeros, k
        assert torch_lr == pytest.approx(graph_lr) and graph_lr == pytest.approx(keras_lr), k
        nonzero_c1_seen |= torch_zeros[0] == 10
    assert nonzero_c1_seen and keras_rows[-1][1][0] < 10  # ConstantKS held the zeros, then let go
    assert keras_rows[-1][1][2] < round(0.7 * 1280)  # GradualKS released (leave_enabled: false)
