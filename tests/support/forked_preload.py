"""What the server of :mod:`tests.support.forked` imports once, before it forks a program: the heavy libraries and recal,
and the modules torch's ONNX exporter and transformers load on first use (2 s and 3 s in every new interpreter).

Importing only: nothing here computes, starts a thread pool or builds a model, so each forked program starts as a
new interpreter would after its imports. Under a worker, onnxruntime sessions default to one thread, as in the
worker (tests/support/one_thread_sessions.py)."""

import os

import onnx  # noqa: F401
import onnxruntime  # noqa: F401
import onnxscript.function_libs.torch_lib.ops  # noqa: F401
import torch
import torch._dynamo
import torch.export
import torch.onnx._internal.exporter._core  # noqa: F401

import recal_core  # noqa: F401
import recal_onnx  # noqa: F401
import recal_torch  # noqa: F401

try:
    import transformers.modeling_utils  # noqa: F401
except ImportError:  # the transformers extra not installed: its tests skip
    pass

try:
    import keras  # noqa: F401
    import tensorflow  # noqa: F401

    import recal_keras  # noqa: F401
    import recal_tf  # noqa: F401
except ImportError:  # the TensorFlow extra not installed: its tests skip
    pass

import recal_app.training  # noqa: F401

if os.environ.get("PYTEST_XDIST_WORKER"):  # as in the worker that forks the program (tests/conftest.py)
    from tests.support.one_thread_sessions import install

    install()
