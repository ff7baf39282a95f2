"""`set_random_seed`: Keras' own, without importing TensorFlow in a test process that has not.

`keras.utils.set_random_seed` also seeds TensorFlow when it is installed (the
test extras install it), importing it: 2-3 s of CPU and hundreds of MB in every
test process that seeds, for a generator the torch backend never reads. This
runs Keras' function with its `tf` read as available only once imported, so
Python, NumPy, torch and Keras' global seed are set exactly as Keras sets them,
and TensorFlow too where the process already uses it (the TensorFlow backend).

It imports no kdist: plain-Keras reference processes seed with it too (the same
view as `kdist.keras._compat.serialization`, kept apart for that reason).
"""

import sys

import keras
from keras.src.utils import rng_utils


class _ImportedOnly:
    def __init__(self, lazy_module):
        self._lazy_module = lazy_module

    @property
    def available(self):
        return "tensorflow" in sys.modules and self._lazy_module.available

    def __getattr__(self, name):
        return getattr(self._lazy_module, name)


def set_random_seed(seed):
    lazy = rng_utils.tf
    rng_utils.tf = _ImportedOnly(lazy)
    try:
        keras.utils.set_random_seed(seed)
    finally:
        rng_utils.tf = lazy
