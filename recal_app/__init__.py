"""The ``recal`` application: ``recal train`` (the bundled digits classifier, three frameworks, checkpoints, reports,
run locks), ``recal demo``, ``recal plan`` (a recipe planned from measurement), ``recal check``, ``recal schema``
and ``recal quantize-qat-export``, built on the libraries
(recal_core, recal_torch, recal_keras, recal_tf, recal_onnx), which know nothing of it."""

import importlib as _importlib

# An application, not a library: its interface is the `recal` command (``main``) and the few functions the
# repository's scripts drive (``make demo``, the benchmarks). They load when asked for, so that `recal --help` starts
# without the frameworks.
_SCRIPTED = {"main": "cli", "demo": "demo", "run_jobs": "demo", "print_jobs": "demo", "JOBS": "demo",
             "train": "training", "digits_model": "keras_digits"}
__all__ = sorted(_SCRIPTED)


def __getattr__(name: str):
    """The command's entry point and the scripts' functions, imported when first asked for."""
    if name in _SCRIPTED:
        return getattr(_importlib.import_module(f".{_SCRIPTED[name]}", __name__), name)
    raise AttributeError(f"module 'recal_app' has no attribute {name!r}")
