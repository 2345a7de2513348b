"""``constants_to_initializers`` on tiny graphs: its rewrites, the op types after, the numbers in onnxruntime."""

import numpy as np
import pytest

from recal_onnx.passes.constants_to_initializers import constants_to_initializers
from recal_onnx.passes.conv_to_qlinearconv import conv_to_qlinearconv
from recal_onnx.passes.fold_constants import fold_constants
from recal_onnx.passes.fold_pads_into_convs import fold_pads_into_convs
from tests.onnx.passes.graphs import _apply, _x
from tests.support.onnx_graphs import Builder, ops, reference, run


@pytest.mark.parametrize("pads, value, folds", [
    ([0, 0, 0, 1, 0, 0, 1, 2], 0.0, True),     # TF-style "same": more after than before
    ([0, 0, 1, 1, 0, 0, 1, 1], 0.5, False),    # not zeros: not the conv's padding
    ([1, 0, 0, 0, 0, 0, 0, 0], 0.0, False),    # a batch pad is no conv padding
    ([0, 0, -1, 0, 0, 0, 0, 0], 0.0, False),   # a negative pad crops
])
@pytest.mark.parametrize("conv_padding", [{"pads": [1, 0, 0, 1]}, {"auto_pad": "VALID"}])
def test_fold_pads_into_convs(pads, value, folds, conv_padding):
    """Hugging Face's EfficientNet writes ``Pad -> Conv(auto_pad=VALID)``, its pads computed by a chain of ops
    (folded to a constant before this pass)."""
    b = Builder()
    x = b.qdq("x", 0.05, 128)
    computed = b.node("Cast", [b.node("Concat", [b.const(np.array(pads[:4], np.float32)),
                                                 b.const(np.array(pads[4:], np.float32))], axis=0)], to=7)
    padded = b.node("Pad", [x, computed, b.const(np.float32(value))])
    y = b.qdq(b.node("Conv", [padded, b.weight([4, 3, 3, 3])], **conv_padding), 0.1, 128)
    model = b.model([("x", [1, 3, 6, 6])], [y])
    feeds = _x([1, 3, 6, 6])
    expected = reference(model, feeds)[0]
    converted, (_, _, n, m) = _apply(model, constants_to_initializers, fold_constants, fold_pads_into_convs,
                                     conv_to_qlinearconv)
    assert n == folds and ("Pad" in ops(converted)) != folds
    if folds:
        assert m == 1 and "QLinearConv" in ops(converted)
    np.testing.assert_allclose(run(converted, feeds)[0], expected, atol=0.1 * 1.0001)  # at most one output step
