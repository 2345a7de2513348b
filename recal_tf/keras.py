"""The name Keras support had before it had its own package: ``recal_tf.keras`` is :mod:`recal_keras`."""

import sys as _sys

import recal_keras as _recal_keras

_sys.modules[__name__] = _recal_keras
