"""``masks_to_exact_zeros`` on tiny graphs: its rewrites, the op types after, the numbers in onnxruntime."""

import numpy as np
import pytest

from recal_onnx.findings import Findings
from recal_onnx.passes.masks_to_exact_zeros import masks_to_exact_zeros
from tests.onnx.passes.graphs import _apply, _masked_attention
from tests.support.onnx_graphs import reference, run


@pytest.mark.parametrize("value, also_read_by, tensor, whole_row, rewritten", [
    (-100.0, None, False, False, True), (-64.0, None, False, False, True),  # HF Swin's mask; the least a mask may be
    (-100.0, None, True, False, True),  # timm Swin's: a constant
    (-100.0, "Mul", False, False, False), (-100.0, "Mul", True, False, False),  # the mask's values used elsewhere too
    (-100.0, None, True, True, False),  # a row masked whole: its probabilities are its scores' softmax
    (-5.0, None, False, False, False), (-1e5, None, False, False, False),  # not a mask; exact zeros already
], ids=["swin", "edge", "timm", "read-elsewhere", "read-elsewhere-timm", "whole-row", "not-a-mask", "exact-already"])
def test_masks_to_exact_zeros(value, also_read_by, tensor, whole_row, rewritten):
    """A softmax mask of -100 leaves float32 denormals (exp(-100) = 3.7e-44, slow on Intel CPUs); -10000 leaves
    exact zeros, and every other output bit for bit."""
    model = _masked_attention(value, also_read_by, tensor, whole_row)
    feeds = {"s": np.random.default_rng(1).uniform(-2, 2, (2, 4, 4)).astype(np.float32)}
    before = reference(model, feeds)
    findings = Findings()
    converted, (n,) = _apply(model, masks_to_exact_zeros, findings=findings)
    assert n == rewritten and bool(findings.masked_scores) == rewritten, findings.masked_scores
    after = run(converted, feeds)
    denormal = lambda p: int(((p != 0) & (np.abs(p) < np.finfo(np.float32).tiny)).sum())  # noqa: E731
    masked = np.triu(np.ones((4, 4), bool), 1)
    if rewritten:
        assert denormal(before[1]) > 0 if value == -100 else (before[1][:, masked] > 0).all()  # -64: e^-64, normal
        assert denormal(after[1]) == 0 and (after[1][:, masked] == 0).all()
        assert list(findings.masked_scores.values()) == [value]
        np.testing.assert_array_equal(after[0], before[0])
    else:
        np.testing.assert_array_equal(after[1], before[1])
