"""`set_random_seed`: Keras' own, without importing TensorFlow in a test process that has not.

`keras.utils.set_random_seed` also seeds TensorFlow when it is installed (the
test extras install it), importing it: 2-3 s of CPU and hundreds of MB in every
test process that seeds, for a generator the torch backend never reads. This
runs Keras' function with its `tf` read as available only once imported
(`kdist.keras._compat.serialization.imported_only`), so Python, NumPy, torch and
Keras' global seed are set exactly as Keras sets them, and TensorFlow too where
the process already uses it (the TensorFlow backend).
"""

import keras
from keras.src.utils import rng_utils

from kdist.keras._compat.serialization import imported_only


def set_random_seed(seed):
    lazy = rng_utils.tf
    rng_utils.tf = imported_only(lazy)
    try:
        keras.utils.set_random_seed(seed)
    finally:
        rng_utils.tf = lazy
