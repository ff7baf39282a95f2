"""`set_random_seed`: Keras' own, without importing TensorFlow in a test process that has not.

`keras.utils.set_random_seed` also seeds TensorFlow when it is installed (the
test extras install it), importing it: 2-3 s of CPU and hundreds of MB in every
test process that seeds, for a generator the torch backend never reads. Where
the process has not imported TensorFlow, this runs Keras' function with its
`tf` reading as unavailable, so Python, NumPy, torch and Keras' global seed are
set exactly as Keras sets them; where it has (the TensorFlow backend), it is
Keras' function as is. It imports no kdist: plain-Keras reference processes seed
with it too.
"""

import sys
import types

import keras
from keras.src.utils import rng_utils

_UNAVAILABLE = types.SimpleNamespace(available=False)


def set_random_seed(seed):
    if "tensorflow" in sys.modules:
        keras.utils.set_random_seed(seed)
        return
    lazy, rng_utils.tf = rng_utils.tf, _UNAVAILABLE
    try:
        keras.utils.set_random_seed(seed)
    finally:
        rng_utils.tf = lazy
