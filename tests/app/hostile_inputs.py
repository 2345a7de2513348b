"""The runs, models and checks the hostile-input tests share."""

import os
import time

import numpy as np
import onnx
import pytest

from recal_core import RecipeError, load_recipe
from tests.support.cli_in_process import run_recal
from tests.support.hang_guard import HANG_SECONDS
from tests.support.paths import ROOT

DENSE = ROOT / "recal_core" / "recipes" / "dense.yaml"


_cli = run_recal  # in this process: most cases check one refusal's line (tests/support/cli_in_process.py)


def _one_line(result, code=2):
    lines = result.stderr.strip().splitlines()
    assert result.returncode == code and len(lines) == 1, (result.returncode, result.stderr[-2000:])
    return lines[0]


def _loads_quickly(text, peak_bytes=None):
    """The recipe is refused, not hung (:data:`HANG_SECONDS`); with ``peak_bytes``, also without allocating that
    much on the way (memory is the deterministic sign that a costly operation was refused before it ran; traced only
    where asked: tracing slows Python down)."""
    import tracemalloc

    started = time.perf_counter()
    if peak_bytes is not None:
        tracemalloc.start()
    try:
        with pytest.raises(RecipeError) as err:
            load_recipe(text).bind(100)
        peak = tracemalloc.get_traced_memory()[1] if peak_bytes is not None else 0
    finally:
        if peak_bytes is not None:
            tracemalloc.stop()
    assert time.perf_counter() - started < HANG_SECONDS
    assert peak_bytes is None or peak < peak_bytes, f"{peak:,} bytes allocated on the way to the refusal"
    assert "internal error" not in str(err.value)
    return str(err.value)


class _Evil:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


KILLED_AFTER_THE_THIRD_SAVE = """
import os, signal, sys
import recal_app.tf_trainer as tf_train
from recal_core import load_recipe
from recal_app.training import train

real, calls = tf_train.write_text_atomically, []


def killed_after_the_third_save(path, text):
    calls.append(path)
    if len(calls) == 3:  # epoch 3's checkpoint is saved, its history.json never written
        os.kill(os.getpid(), signal.SIGKILL)  # no finally block, no atexit, no flush: what kill -9 does
    return real(path, text)


tf_train.write_text_atomically = killed_after_the_third_save
train(load_recipe(sys.argv[1]), "tf", sys.argv[2], epochs=3, progress=False)
"""


def _frozen_weights(path):
    """The constants of a frozen graph, as bytes (two identical runs serialise the GraphDef differently)."""
    import tensorflow as tf

    graph = tf.compat.v1.GraphDef()
    graph.ParseFromString(path.read_bytes())
    return {n.name: n.attr["value"].tensor.tensor_content for n in graph.node if n.op == "Const"}


_RANGE = "\nmodifiers:\n- !EpochRangeModifier {start_epoch: 0, end_epoch: 3}\n"


def _qdq_model(opset=17, domain=""):
    from tests.support.onnx_graphs import Builder

    b = Builder()
    y = b.node("Relu", [b.qdq("x", 0.1, 0)], domain=domain or None)
    model = b.model([("x", [1, 4])], [b.qdq(y, 0.1, 0)])
    model.opset_import[0].version = opset
    if domain:
        model.opset_import.append(onnx.helper.make_opsetid(domain, 1))
    return model


def _converter_cases():
    """Inputs the converter once met with a raw exception or an invalid model: each built by name."""
    from onnx import TensorProto, helper

    from tests.support.onnx_graphs import Builder

    b = Builder()
    y = b.node("Max", [b.qdq("x", 0.1, 128), b.const(np.float32(np.nan))])
    yield "a NaN bound", b.model([("x", [None, 4])], [b.qdq(y, 0.1, 128)]), r"Max 'Max\d+' has a NaN bound"
    b = Builder()
    y = b.qdq(b.node("Relu", [b.qdq("x", 0.1, 128)]), 0.1, 128)
    sequence = b.node("SequenceConstruct", [y])
    model = b.model([("x", [None, 4])], [y])
    model.graph.output.append(helper.make_tensor_sequence_value_info(sequence, TensorProto.FLOAT, None))
    yield "a sequence output", model, r"output 'sequenceconstruct\d+' is a sequence, not a tensor"
    b = Builder()
    q = np.random.default_rng(0).integers(-7, 8, (8, 16)).astype(np.int8)
    w = b.node("DequantizeLinear", [b.const(q), b.const(np.full(8, 0.1, np.float32)), b.const(np.zeros(8, np.int8))],
               axis=0)
    y = b.node("Gemm", ["x", w, b.const(np.ones((8, 1), np.float32))], transB=1)
    yield "a bias that does not broadcast", b.model([("x", [4, 16])], [y]), \
        r"does not run in onnxruntime itself, as written: .*Gemm\d+.*bias"
