"""The ``recal`` application: ``recal train`` (the bundled digits classifier, three frameworks, checkpoints, reports,
run locks), ``recal demo``, ``recal plan`` (a recipe planned from measurement), ``recal check``, ``recal schema``
and ``recal quantize-qat-export``, built on the libraries
(recal_core, recal_torch, recal_keras, recal_tf, recal_onnx), which know nothing of it."""

__all__: list[str] = []  # an application, not a library: its interface is the `recal` command
