"""onnxruntime sessions given no thread count get one, in the suite's workers and the programs they fork.

onnxruntime ignores OMP_NUM_THREADS: a session makes a thread per core, and they spin while they wait for work,
against the other worker (tests/e2e/zoo/test_cnns.py + tests/onnx/test_onnx_convert.py on 2 workers: 81.5 s, 61.7 s with
one thread). A session's graph optimizations (the default level unless the test sets another) are unchanged."""

from __future__ import annotations

from typing import Callable


def install() -> Callable[[], None]:
    """Replace ``onnxruntime.InferenceSession`` with a subclass that defaults to one intra-op thread; returns the
    function that puts the original back (a no-op without onnxruntime)."""
    try:
        import onnxruntime as ort
    except ImportError:
        return lambda: None
    real = ort.InferenceSession

    class OneThread(real):
        def __init__(self, path_or_bytes, sess_options=None, *args, **kwargs):
            if sess_options is None:
                sess_options = ort.SessionOptions()
            if sess_options.intra_op_num_threads == 0:
                sess_options.intra_op_num_threads = 1
            super().__init__(path_or_bytes, sess_options, *args, **kwargs)

    ort.InferenceSession = OneThread

    def restore() -> None:
        ort.InferenceSession = real

    return restore
